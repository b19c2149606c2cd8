"""make-model folders load back: in this engine, in transformers (weights, tokenizer, chat template), and the CLI
writes them; dummy weights are seeded per tensor; fingerprints tell weight sources apart."""

import json

import pytest
import torch

from kvshare.cli import main
from kvshare.engine.model import Rotary
from kvshare.engine.weights import load_model
from kvshare.hf.config import ModelConfig
from kvshare.hf.tokenizer import Tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, 42 cats!"}]


def test_folder_loads_in_engine_and_transformers(tiny_model):
    transformers = pytest.importorskip("transformers")
    ours = load_model(tiny_model, "auto", "cpu", torch.float32).model
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    tokens = torch.arange(3, 40)
    caches = [torch.zeros(8, 2, 16, 2, 32) for _ in range(2)]
    logits = ours.prefill(tokens, 0, caches, torch.arange(8), Rotary(ours.config, torch.device("cpu"),
                                                                      torch.float32), chunk=16)
    with torch.no_grad():
        expected = reference(tokens[None]).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)

    tokenizer = Tokenizer.from_dir(tiny_model)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model)
    text = "The quick brown fox, 1234 times."
    assert tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.apply_chat_template(MESSAGES) == hf_tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)
    assert tokenizer.vocab_size == ModelConfig.from_dir(tiny_model).vocab_size == len(hf_tokenizer)
    im_end = tokenizer.encode("<|im_end|>")
    assert len(im_end) == 1 and im_end[0] in tokenizer.eos_token_ids


def test_dummy_weights_are_seeded_per_tensor(tiny_model):
    loaded = [load_model(tiny_model, "dummy", "cpu", torch.bfloat16, seed=seed) for seed in (1, 1, 2)]
    a, b, c = (one.model.state_dict() for one in loaded)
    name = "model.layers.1.self_attn.k_proj.weight"
    assert all(torch.equal(a[k], b[k]) for k in a) and not torch.equal(a[name], c[name])
    assert a[name].dtype == torch.bfloat16 and 0.015 < a[name].float().std() < 0.025
    assert torch.equal(a["model.norm.weight"], torch.ones_like(a["model.norm.weight"]))
    prints = [one.fingerprint for one in loaded] + [load_model(tiny_model, "auto", "cpu", torch.bfloat16).fingerprint]
    assert prints[0] == prints[1] and len(set(prints)) == 3


def test_cli_writes_config_only_32b_preset(tmp_path):
    assert main(["make-model", "--preset", "qwen2.5-32b", "--out", str(tmp_path / "q")]) == 0
    config = ModelConfig.from_dir(tmp_path / "q")
    assert (config.architecture, config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads,
            config.head_dim, config.intermediate_size, config.vocab_size, config.qkv_bias, config.max_position) == (
        "Qwen2ForCausalLM", 5120, 64, 40, 8, 128, 27648, 152064, True, 262144)
    assert config.rope.theta == 1e6 and not list((tmp_path / "q").glob("*.safetensors"))
    assert json.loads((tmp_path / "q" / "generation_config.json").read_text())["eos_token_id"]
    with pytest.raises(FileNotFoundError, match="load-format dummy"):
        load_model(tmp_path / "q", "auto", "cpu", torch.float32)


def test_every_id_of_a_config_only_preset_decodes_to_text(tmp_path):
    """The 32B shape trains a 1k BPE; the rest of its 152k ids must still be text, or a dummy model's answer streams
    nothing and no client sees a first token."""
    from kvshare.engine.make_model import make_model

    tokenizer = Tokenizer.from_dir(make_model("qwen2.5-32b", tmp_path / "q"))
    assert tokenizer.vocab_size == 152064
    assert [tokenizer.decode([i]) for i in (2000, 100000, 152063)] == ["<|t976|>", "<|t98976|>", "<|t151039|>"]


def test_placeholder_ids_are_vocabulary_not_added_tokens(tmp_path):
    """Ids past the trained BPE are plain vocabulary entries: transformers (and so vLLM, three times a replica start)
    deep-copies every added token at load, 4-8 s for 151k of them. Text never encodes to a placeholder."""
    from kvshare.engine.make_model import make_model

    transformers = pytest.importorskip("transformers")
    folder = make_model("qwen2.5-32b", tmp_path / "q")
    added = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    assert all(token["special"] for token in added) and len(added) < 16
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert len(hf_tokenizer) == 152064 and hf_tokenizer.decode([152063]) == "<|t151039|>"
    assert max(Tokenizer.from_dir(folder).encode("a <|t5|> b")) < 1024
