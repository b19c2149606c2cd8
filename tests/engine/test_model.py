"""The engine's model against Hugging Face transformers (fp32, tiny random configs), full prompt and paged chunks."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvshare.engine.attention import decode_step  # noqa: E402
from kvshare.engine.model import Rotary  # noqa: E402
from kvshare.engine.weights import load_model  # noqa: E402

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=10000.0)),
    "llama3-scaled-tied": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64))),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, rope_theta=1e6)),
}


def hf_model(kind, out_dir):
    config_cls, model_cls, extra = ARCHS[kind]
    config = getattr(transformers, config_cls)(**BASE, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # give biases and norms non-trivial values so that they are tested too
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out_dir)
    return model


def make_cache(config, num_blocks=64, block_size=4):
    return [torch.zeros(num_blocks, 2, block_size, config.num_kv_heads, config.head_dim)
            for _ in range(config.num_layers)]


def decode(model, tokens, positions, caches, tables, rotary):
    """One eager decode step through the gathered path."""
    rotary.ensure(max(positions) + 1)
    step = decode_step(tables, positions, caches[0].shape[2])
    return model.decode(tokens, torch.tensor(positions), caches, step, rotary)


@pytest.mark.parametrize("kind", list(ARCHS))
def test_logits_match_transformers(kind, tmp_path):
    reference = hf_model(kind, tmp_path)
    model = load_model(tmp_path, "auto", "cpu", torch.float32).model
    tokens = torch.randint(0, BASE["vocab_size"], (37,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens[None]).logits[0]  # (T, vocab)
    rotary = Rotary(model.config, torch.device("cpu"), torch.float32)

    # Whole prompt in one prefill, with token-wise chunks of 8 and a scrambled block table.
    caches = make_cache(model.config)
    table = torch.randperm(64, generator=torch.Generator().manual_seed(2))
    last = model.prefill(tokens, 0, caches, table, rotary, chunk=8)
    torch.testing.assert_close(last[0], expected[-1], atol=1e-4, rtol=1e-4)

    # Chunked: prefill 13 tokens, then 11 attending to them (lower-right mask), then decode the rest one by one.
    caches = make_cache(model.config)
    first = model.prefill(tokens[:13], 0, caches, table, rotary, chunk=5)
    torch.testing.assert_close(first[0], expected[12], atol=1e-4, rtol=1e-4)
    second = model.prefill(tokens[13:24], 13, caches, table, rotary, chunk=4)
    torch.testing.assert_close(second[0], expected[23], atol=1e-4, rtol=1e-4)
    for p in range(24, 37):
        step = decode(model, tokens[p : p + 1], [p], caches, [table], rotary)
        torch.testing.assert_close(step[0], expected[p], atol=1e-4, rtol=1e-4)


def test_batched_decode_matches_single(tmp_path):
    hf_model("qwen2", tmp_path)
    model = load_model(tmp_path, "auto", "cpu", torch.float32).model
    rotary = Rotary(model.config, torch.device("cpu"), torch.float32)
    caches = make_cache(model.config)
    tables = [torch.arange(0, 32), torch.arange(32, 64)]
    prompts = [torch.arange(10, 19), torch.arange(40, 45)]
    for prompt, table in zip(prompts, tables):
        model.prefill(prompt, 0, caches, table, rotary, chunk=4)
    batched = decode(model, torch.tensor([7, 8]), [9, 5], caches, tables, rotary)
    singles = [decode(model, torch.tensor([t]), [p], caches, [tb], rotary)[0]
               for t, p, tb in ((7, 9, tables[0]), (8, 5, tables[1]))]
    torch.testing.assert_close(batched, torch.stack(singles), atol=1e-5, rtol=1e-5)


def test_q_k_v_are_views_of_one_fused_tensor_and_nothing_keeps_the_originals(tmp_path):
    """The loader fuses each layer's q|k|v (Attention.fuse_qkv): the three parameters keep their names and values as
    views of one tensor, and no autograd graph holds the unfused originals (32B: 4.7 GB of GPU memory)."""
    reference = hf_model("qwen2", tmp_path)
    attn = load_model(tmp_path, "auto", "cpu", torch.float32).model.model.layers[0].self_attn
    fused, expected = attn.qkv_weight, reference.model.layers[0].self_attn
    assert fused.grad_fn is None and not fused.requires_grad
    for name in ("q_proj", "k_proj", "v_proj"):
        weight = getattr(attn, name).weight
        assert weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
        assert torch.equal(weight, getattr(expected, name).weight)
    assert attn.qkv_bias is not None and attn.qkv_bias.grad_fn is None  # qwen2 has q/k/v biases
