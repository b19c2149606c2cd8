"""The engine's model on CUDA (skipped without a GPU): fp32 CUDA == fp32 CPU, and bf16 chunked prefill over a cached
prefix stays close to the whole-prompt prefill (is_causal), both for a short tail after a long prefix (lower-right
mask) and for a long tail after a short prefix (the square form: zero rows before the tail)."""

import pytest
import torch

from kvshare.engine.model import Rotary
from kvshare.engine.weights import load_model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def last_logits(model, tokens, device, dtype, split=None):
    c = model.config
    caches = [torch.zeros(64, 2, 16, c.num_kv_heads, c.head_dim, device=device, dtype=dtype)
              for _ in range(c.num_layers)]
    table = torch.randperm(64, generator=torch.Generator().manual_seed(0)).to(device)
    rotary = Rotary(c, torch.device(device), dtype)
    tokens = tokens.to(device)
    if split:
        model.prefill(tokens[:split], 0, caches, table, rotary, chunk=64)
        return model.prefill(tokens[split:], split, caches, table, rotary, chunk=64)[0]
    return model.prefill(tokens, 0, caches, table, rotary, chunk=64)[0]


def test_cuda_matches_cpu_and_cached_prefix(tiny_model):
    tokens = torch.randint(3, 1000, (700,), generator=torch.Generator().manual_seed(1))
    cpu = last_logits(load_model(tiny_model, "auto", "cpu", torch.float32).model, tokens, "cpu", torch.float32)
    gpu = last_logits(load_model(tiny_model, "auto", "cuda", torch.float32).model, tokens, "cuda", torch.float32)
    torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-3, rtol=1e-3)
    bf16 = load_model(tiny_model, "auto", "cuda", torch.bfloat16).model
    whole = last_logits(bf16, tokens, "cuda", torch.bfloat16)
    split = last_logits(bf16, tokens, "cuda", torch.bfloat16, split=512)
    long_tail = last_logits(bf16, tokens, "cuda", torch.bfloat16, split=48)
    print(f"bf16 whole vs split max |diff| {float((whole - split).abs().max()):.4f}; "
          f"bf16 vs fp32 {float((whole.cpu() - cpu).abs().max()):.4f}; "
          f"top-1 agree {int(whole.argmax()) == int(split.argmax()) == int(cpu.argmax())}")
    torch.testing.assert_close(split, whole, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(long_tail, whole, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(whole.cpu(), cpu, atol=5e-2, rtol=5e-2)
