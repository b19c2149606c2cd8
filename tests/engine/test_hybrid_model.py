"""The hybrid (Qwen3.5) model in the reference engine: it computes what transformers' own Qwen3_5ForCausalLM computes
from the same folder, its state crosses prefill and decode steps, and its config is read as transformers reads it."""

from __future__ import annotations

import json

import pytest
import torch

from kvshare.engine.api import GenerationRequest, SamplingParams
from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine, generate
from kvshare.engine.make_model import PRESETS, hf_config
from kvshare.hf.config import ModelConfig

PROMPT = [(i * 104729) % 1000 + 3 for i in range(150)]


def engine_tokens(model_dir, prompts, max_tokens=12, **fields):
    engine = Engine(EngineConfig(**{"model": str(model_dir), "max_model_len": 1024, "num_blocks": 128, **fields}))
    try:
        requests = [GenerationRequest(f"r{i}", tuple(p), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                    for i, p in enumerate(prompts)]
        results = generate(engine, requests, timeout=120)
        return [r.token_ids for r in results]
    finally:
        engine.shutdown()


def transformers_torch_forms(monkeypatch) -> None:
    """transformers calls flash-linear-attention's (and causal-conv1d's) Triton kernels in place of its torch forms
    whenever those packages import, CPU tensors or not (a Triton "cpu tensor?" error on a machine with fla-core, as
    the H200 host has); the reference here is the torch forms, which each wrapper keeps as __wrapped__."""
    import importlib
    import inspect

    modeling = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update"):
        monkeypatch.setattr(modeling, name, inspect.unwrap(getattr(modeling, name)))


def test_greedy_tokens_and_logits_equal_transformers(hybrid_model, monkeypatch):
    """The same folder through transformers' Qwen3_5ForCausalLM (its torch reference forms) gives the same greedy
    tokens, and the prompt's last logits agree to fp32 rounding: the layer pattern, the gated attention with partial
    rotary and zero-centred norms, the conv and the gated delta rule are the public model's."""
    transformers = pytest.importorskip("transformers")
    transformers_torch_forms(monkeypatch)
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(hybrid_model), dtype=torch.float32).eval()
    assert type(reference).__name__ == "Qwen3_5ForCausalLM"
    with torch.no_grad():
        expected = reference.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)[0, len(PROMPT):]
        expected_logits = reference(torch.tensor([PROMPT])).logits[0, -1]
    assert engine_tokens(hybrid_model, [PROMPT]) == [expected.tolist()]
    engine = Engine(EngineConfig(model=str(hybrid_model), max_model_len=1024, num_blocks=128), start=False)
    from kvshare.engine.sequence import Sequence

    seq = Sequence(GenerationRequest("x", tuple(PROMPT), SamplingParams(max_tokens=1)), lambda event: None)
    engine.block_manager.allocate(seq)
    logits = engine.runner.prefill(seq)[0]
    torch.testing.assert_close(logits, expected_logits, atol=2e-5, rtol=1e-4)


def test_batched_decode_equals_decoding_alone(hybrid_model):
    """Sequences decoded together (their states gathered from and scattered back to their slots) give each the
    tokens it gets alone: slots never mix."""
    prompts = [PROMPT, PROMPT[:70], PROMPT[40:]]
    alone = [engine_tokens(hybrid_model, [p])[0] for p in prompts]
    assert engine_tokens(hybrid_model, prompts) == alone


def test_preempted_sequences_recompute_their_state(hybrid_model, monkeypatch):
    """With KV blocks for about one sequence at a time, requests are preempted and recomputed from 0 (their state
    slot cleared, maybe taken by another): the answers are those of running alone."""
    from kvshare.engine.scheduler import Scheduler

    prompts = [PROMPT[:40], PROMPT[20:60], PROMPT[50:90]]  # admitted together, then they outgrow 12 blocks
    alone = [engine_tokens(hybrid_model, [p], max_tokens=60)[0] for p in prompts]
    preempted = []
    original = Scheduler.preempt
    monkeypatch.setattr(Scheduler, "preempt", lambda self, seq: (preempted.append(seq), original(self, seq)))
    assert engine_tokens(hybrid_model, prompts, max_tokens=60, num_blocks=12) == alone
    assert preempted  # the case under test happened


def test_config_reads_the_layer_pattern_as_transformers_does():
    """layer_types when given, else every full_attention_interval-th layer full; the 27B preset is Qwen3.5-27B's
    published shape: 16 full-attention layers of 64, KV only in those, a quarter of each head rotated."""
    config = hf_config(PRESETS["qwen3.5-27b"], 0, 1)
    parsed = ModelConfig.from_hf(config)
    assert parsed.attention_layers == tuple(range(3, 64, 4)) and parsed.rotary_dim == 64
    assert parsed.kv_bytes_per_token("bfloat16") == 16 * 2 * 4 * 256 * 2  # 64 KiB: a quarter of a dense 32B's
    without_list = {k: v for k, v in config.items() if k != "layer_types"}
    assert ModelConfig.from_hf(without_list).linear.layer_types == parsed.linear.layer_types
    with pytest.raises(ValueError, match="layer_types must list 64"):
        ModelConfig.from_hf({**config, "layer_types": ["linear_attention"] * 3})
    with pytest.raises(ValueError, match="text model"):
        ModelConfig.from_hf({**config, "architectures": ["Qwen3_5ForConditionalGeneration"]})
    json.dumps(config)  # what make-model writes is JSON


def test_serve_refuses_a_hybrid_chunk_off_the_linear_blocks(hybrid_model, tiny_model):
    """`kvshare serve --chunk-tokens 80` on a hybrid model is a one-line error naming a size that works; a dense model
    takes any multiple of the block size."""
    from kvshare.serve.cli import check_hybrid_chunk

    with pytest.raises(ValueError, match="multiple of 64 tokens .* try 64"):
        check_hybrid_chunk(str(hybrid_model), 80)
    check_hybrid_chunk(str(hybrid_model), 128)
    check_hybrid_chunk(str(tiny_model), 80)


def test_a_prefill_in_pieces_gives_the_whole_spans_tokens(hybrid_model):
    """The linear layers run a long span in pieces of --prefill-chunk tokens (the state carried from piece to
    piece; a 256k span at once does not fit an H200 beside the 27B weights): pieces of 64 tokens, with the prompt's
    tail mid-piece, give the tokens of one piece per span."""
    prompt = PROMPT + PROMPT[:37]  # 187 tokens: two whole 64-token pieces and a part
    assert engine_tokens(hybrid_model, [prompt], prefill_chunk=64) == engine_tokens(hybrid_model, [prompt])
