"""`kvshare make-model`: writes a loadable Hugging Face model folder (config, random weights, a locally trained
byte-level BPE tokenizer with a ChatML template), so tests, demos and benchmarks need no download."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvshare.engine.weights import dummy_state_dict
from kvshare.hf.config import ModelConfig

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS, EOS = "<|endoftext|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class LinearPreset:
    """A hybrid preset's Gated DeltaNet layers: every `full_attention_interval`-th layer is full attention."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    full_attention_interval: int = 4
    conv_kernel: int = 4
    partial_rotary_factor: float = 0.25


@dataclass(frozen=True)
class Preset:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int
    rope_theta: float
    tokenizer_vocab: int  # trained BPE size; the rest of the model's vocab is filled with reserved tokens (if any)
    weights_dtype: str | None  # None: config only, for --load-format dummy
    linear: LinearPreset | None = None  # a hybrid (Qwen3.5) model's linear-attention layers


HYBRID = "Qwen3_5ForCausalLM"
PRESETS = {
    "tiny": Preset("LlamaForCausalLM", 128, 256, 2, 4, 2, 32, 1024, 4096, 10000.0, 1024, "float32"),
    "small": Preset("LlamaForCausalLM", 1024, 2816, 12, 16, 4, 64, 8192, 16384, 10000.0, 8192, "bfloat16"),
    "qwen2.5-32b": Preset("Qwen2ForCausalLM", 5120, 27648, 64, 40, 8, 128, 152064, 262144, 1e6, 1024, None),
    # Hybrid: 3 of every 4 layers Gated DeltaNet, the 4th gated full attention (Qwen3.5's text model).
    "tiny-hybrid": Preset(HYBRID, 128, 256, 4, 4, 2, 32, 1024, 4096, 1e7, 1024, "float32",
                          LinearPreset(2, 4, 32, 32)),
    "small-hybrid": Preset(HYBRID, 1024, 2816, 12, 16, 4, 64, 8192, 16384, 1e7, 8192, "bfloat16",
                           LinearPreset(8, 16, 64, 64)),
    # The shape of Qwen/Qwen3.5-27B's text model (its model card and config.json: 64 layers laid out as
    # 16 x (3 Gated DeltaNet + 1 gated attention), hidden 5120, FFN 17408, attention 24 q / 4 kv heads of 256 with
    # a 64-dim rotary part, DeltaNet 16 qk / 48 v heads of 128, conv kernel 4, vocab 248320, rope theta 1e7,
    # 262144 positions). Config only: served with --load-format dummy.
    "qwen3.5-27b": Preset(HYBRID, 5120, 17408, 64, 24, 4, 256, 248320, 262144, 1e7, 1024, None,
                          LinearPreset(16, 48, 128, 128)),
}


def hf_config(p: Preset, bos_id: int, eos_id: int) -> dict:
    config = {
        "architectures": [p.architecture],
        "model_type": "qwen2" if p.architecture == "Qwen2ForCausalLM" else "llama",
        "vocab_size": p.vocab_size,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_kv_heads,
        "head_dim": p.head_dim,
        "max_position_embeddings": p.max_position,
        "rms_norm_eps": 1e-6,
        "rope_theta": p.rope_theta,
        "rope_scaling": None,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": p.weights_dtype or "bfloat16",
        "use_cache": True,
    }
    if p.architecture == "Qwen2ForCausalLM":
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=p.num_layers)
    elif p.linear is not None:
        del config["rope_theta"], config["rope_scaling"]  # transformers 5 keeps them in rope_parameters
        config.update(hybrid_fields(p))
    else:
        config.update(attention_bias=False, mlp_bias=False)
    return config


def hybrid_fields(p: Preset) -> dict:
    """config.json fields of a Qwen3.5 text model (model_type qwen3_5_text), as transformers writes them."""
    lin = p.linear
    return {
        "model_type": "qwen3_5_text",
        "attention_bias": False,
        "attn_output_gate": True,
        "full_attention_interval": lin.full_attention_interval,
        "layer_types": ["full_attention" if (i + 1) % lin.full_attention_interval == 0 else "linear_attention"
                        for i in range(p.num_layers)],
        "linear_conv_kernel_dim": lin.conv_kernel,
        "linear_key_head_dim": lin.key_head_dim,
        "linear_value_head_dim": lin.value_head_dim,
        "linear_num_key_heads": lin.num_key_heads,
        "linear_num_value_heads": lin.num_value_heads,
        "mamba_ssm_dtype": "float32",
        "rope_parameters": {"rope_type": "default", "rope_theta": p.rope_theta,
                            "partial_rotary_factor": lin.partial_rotary_factor,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    }


def training_text(seed: int, num_words: int = 120_000) -> list[str]:
    """Deterministic pseudo-English (syllable words, numbers, punctuation) for training the BPE merges."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
    lexicon = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(3000)]
    lexicon += "the of and to in is that for it as with was on be by this are from or at you".split()
    lines, words = [], []
    for _ in range(num_words):
        word = str(rng.randint(0, 9999)) if rng.random() < 0.05 else rng.choice(lexicon)
        words.append(word.capitalize() if not words else word)
        if rng.random() < 0.08:
            lines.append(" ".join(words) + rng.choice([".", "?", "!", ":", ","]))
            words = []
    return lines


def train_tokenizer(vocab_size: int, fill_to: int, seed: int) -> Tokenizer:
    """Byte-level BPE of `vocab_size` tokens, padded with reserved special tokens to exactly `fill_to` when larger."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(training_text(seed), trainer=trainer)
    missing = fill_to - tokenizer.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    return tokenizer


def with_placeholder_ids(tokenizer: Tokenizer, vocab_size: int) -> Tokenizer:
    """`tokenizer` covering ids up to `vocab_size`: the ids past its trained BPE become vocabulary entries `<|tN|>`.

    A real model's tokenizer covers its whole vocabulary, so the tokens a dummy-weight model samples stream as text (a
    client's TTFT is its first text, not its first id). They are BPE vocabulary entries that no merge reaches, not
    added tokens: text never encodes to them, and transformers 5 deep-copies every added token at each load (151k of
    them took 4 s a load here, 7-8 s on the H200 host, three loads per vLLM replica start); a real Qwen tokenizer
    has a few dozen. Decoding any id gives the same text either way."""
    first = tokenizer.get_vocab_size(with_added_tokens=True)
    if first >= vocab_size:
        return tokenizer
    spec = json.loads(tokenizer.to_str())
    spec["model"]["vocab"].update({f"<|t{i}|>": first + i for i in range(vocab_size - first)})
    return Tokenizer.from_str(json.dumps(spec))


def tokenizer_config(model_max_length: int) -> dict:
    """The fields transformers' PreTrainedTokenizerFast (and so vLLM) reads beside tokenizer.json."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": BOS,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def make_model(preset: str, out: str | Path, seed: int = 0) -> Path:
    """Write the preset's folder into `out` (created if needed) and return it."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: use one of {', '.join(PRESETS)}")
    p, out = PRESETS[preset], Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fill = p.vocab_size if p.tokenizer_vocab >= p.vocab_size else 0
    tokenizer = train_tokenizer(p.tokenizer_vocab, fill, seed)
    tokenizer = with_placeholder_ids(tokenizer, p.vocab_size)
    tokenizer.save(str(out / "tokenizer.json"), pretty=False)
    bos_id, eos_id = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    config = hf_config(p, bos_id, eos_id)
    write_json(out / "config.json", config)
    write_json(out / "tokenizer_config.json", tokenizer_config(p.max_position))
    write_json(out / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "pad_token": BOS})
    write_json(out / "generation_config.json",
               {"bos_token_id": bos_id, "eos_token_id": [eos_id, bos_id], "do_sample": False})
    if p.weights_dtype is not None:
        dtype = getattr(torch, p.weights_dtype)
        state = dummy_state_dict(ModelConfig.from_hf(config), seed, "cpu", dtype)
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
