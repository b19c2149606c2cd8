"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) with prefill and decode over the paged KV cache.

Module and parameter names mirror Hugging Face (`model.layers.N.self_attn.q_proj.weight`, ...) so checkpoints load
by name. Prefill runs layer by layer over the whole new span: token-wise work (norms, projections, MLP) in chunks of
`chunk` tokens and attention over the whole sequence per KV-head group, updating the hidden states in place; this
bounds activation memory to about two full-sequence buffers (hidden states and q/attention output) plus one chunk.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvshare.engine import fused_ops
from kvshare.engine.attention import DecodeStep, decode_attention, prefill_attention, slot_indices, tail_plan, write_kv
from kvshare.engine.kv_quant import UNIT
from kvshare.hf.config import ModelConfig, RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps
        self.fused = False  # one Triton kernel (kvshare.engine.fused_ops) instead of torch's seven

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return fused_ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        # Normalise in fp32 and cast back before the weight, as the reference implementations do.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """RoPE inverse frequencies (fp32), with Llama 3.1 scaling: long wavelengths slowed by `factor`, short ones kept,
    the band between interpolated smoothly."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind != "llama3":
        return inv
    wavelen = 2 * math.pi / inv
    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rotary:
    """cos/sin tables for positions [0, n), grown on demand, in the model's dtype on its device; as wide as the
    rotated part of a head (all of it, but for partial rotary)."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype):
        self.inv_freq = inverse_frequencies(config.rope, config.rotary_dim).to(device)
        self.dtype = dtype
        self.cos = self.sin = torch.empty(0, config.rotary_dim, device=device, dtype=dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of shape (T, 1, D) for the given positions (the tables grown first if needed)."""
        self.ensure(int(positions.max()) + 1)
        return self.lookup(positions)

    def ensure(self, n: int) -> None:
        """Tables for positions [0, n) at least. Grows by replacing the tables: a CUDA graph that read the old ones
        must be captured only after ensure(max_model_len) (kvshare.engine.cuda_graphs), so they never grow again."""
        if n > self.cos.shape[0]:
            n = max(n, 2 * self.cos.shape[0])
            freqs = torch.outer(torch.arange(n, device=self.inv_freq.device, dtype=torch.float32), self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos, self.sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of shape (T, 1, D) for positions already covered by ensure(): no host synchronisation."""
        return self.cos[positions][:, None], self.sin[positions][:, None]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (T, heads, D) by the half-split convention: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.head_dim**-0.5
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.qk_norm = c.qk_norm
        self.fused = False  # rotary through kvshare.engine.fused_ops (CausalLM.use_fused_ops)
        self.kv_scales = UNIT  # an fp8 cache's per-tensor scales (the loader sets the checkpoint's; kv_quant.py)

    def fuse_qkv(self) -> None:
        """Store q_proj, k_proj and v_proj's weights (and biases) as one tensor, the three parameters becoming views
        of it, so qkv() runs one matrix product instead of three: at batch 1 on an H200 the 1024-row k and v products
        read their weights at ~0.45 TB/s, the fused one at ~3.1 TB/s (run 19: 4.1 -> 1.5 ms a token over 64 layers).
        Names and values are unchanged (state_dict, identity). The loader calls it; qkv() needs it."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_bias = None
        for name in ("weight", "bias") if self.q_proj.bias is not None else ("weight",):
            # detached: an autograd graph over the originals would keep them alive beside the fused copy
            fused = torch.cat([getattr(p, name).detach() for p in projections])
            offset = 0
            for p in projections:
                size = getattr(p, name).shape[0]
                setattr(p, name, nn.Parameter(fused[offset : offset + size], requires_grad=False))
                offset += size
            setattr(self, f"qkv_{name}", fused)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x (T, hidden) -> roped q (T, heads, D), roped k (T, kv_heads, D), v (T, kv_heads, D)."""
        t, q_size, kv_size = x.shape[0], self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = F.linear(x, self.qkv_weight, self.qkv_bias).split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)  # views: the product's rows are q|k|v
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.fused:  # in place: q and k are this call's own tensors (views of the product, or the norms' outputs)
            fused_ops.rope_(q, k, cos, sin)
            return q, k, v
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def write_kv(self, cache, blocks, offsets, k, v) -> None:
        """k, v of the new tokens into their cache slots (quantized if the cache is fp8)."""
        if self.fused:
            fused_ops.write_kv(cache, blocks, offsets, k, v, self.kv_scales.k, self.kv_scales.v)
        else:
            write_kv(cache, blocks, offsets, k, v, self.kv_scales)


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def prefill(self, h, cache, block_table, start, cos, sin, chunk, plan=None, cache_ready=None):
        """Advance hidden states h (T, hidden) of positions [start, start+T) through this layer, in place; `plan`: the
        tail's attention reads the cache through the paged kernel (kvshare.engine.attention.tail_plan);
        `cache_ready()`: called before the attention, the first read of this layer's cache (the K/V written
        before it go to the new tokens' own slots, which no load touches)."""
        attn, t = self.self_attn, h.shape[0]
        blocks, offsets = slot_indices(block_table, start, start + t, cache.shape[2])
        q = h.new_empty(t, attn.num_heads, attn.head_dim)  # reused for the attention output
        for s in range(0, t, chunk):
            e = min(t, s + chunk)
            q[s:e], k, v = attn.qkv(self.input_layernorm(h[s:e]), cos[s:e], sin[s:e])
            attn.write_kv(cache, blocks[s:e], offsets[s:e], k, v)
        if cache_ready is not None:
            cache_ready()
        prefill_attention(q, cache, block_table, start, attn.scale, attn.kv_scales, plan)
        q = q.view(t, -1)
        for s in range(0, t, chunk):
            e = min(t, s + chunk)
            h[s:e] += attn.o_proj(q[s:e])
            h[s:e] += self.mlp(self.post_attention_layernorm(h[s:e]))

    def decode(self, h, cache, step: DecodeStep, cos, sin):
        """One new token per sequence: h (B, hidden), whose K/V go to `step.slots` (the same in every layer); each
        sequence's K/V spans [0, its position]."""
        attn = self.self_attn
        q, k, v = attn.qkv(self.input_layernorm(h), cos, sin)
        attn.write_kv(cache, *step.slots, k, v)
        out = decode_attention(q, cache, step, attn.scale, attn.kv_scales)
        h = h + attn.o_proj(out.flatten(1))
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class CausalLM(nn.Module):
    """The whole model. Parameters are created on the meta device and assigned by the loader
    (kvshare.engine.weights)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def use_fused_ops(self) -> None:
        """Norms, rotary and K/V writes through kvshare.engine.fused_ops from now on (where the paged kernel runs)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention)):
                module.fused = True

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Next-token logits (fp32) of the hidden states h (N, hidden)."""
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return F.linear(self.model.norm(h), weight).float()

    @torch.inference_mode()
    def prefill(self, token_ids, start, kv_caches, block_table, rotary: Rotary, chunk: int,
                in_place: bool = False, before_attention: Callable[[int], None] | None = None) -> torch.Tensor:
        """Compute K/V of `token_ids` at positions [start, start+T) into the cache (earlier positions must already be
        there, or be made so by before_attention(i) before layer i reads them) and return the logits of the last
        position (1, vocab). `in_place`: see DecoderLayer.prefill."""
        h = self.model.embed_tokens(token_ids)  # (T, hidden), updated in place layer by layer
        # No host synchronization from here to the logits (Rotary.tables would read the positions' maximum back):
        # the host queues the whole forward while a pool load it waits for is still copying.
        rotary.ensure(start + len(token_ids))
        cos, sin = rotary.lookup(torch.arange(start, start + len(token_ids), device=token_ids.device))
        plan = tail_plan(block_table, start, len(token_ids), self.config.num_heads, kv_caches[0], h.dtype, in_place)
        for index, (layer, cache) in enumerate(zip(self.model.layers, kv_caches)):
            ready = None if before_attention is None else functools.partial(before_attention, index)
            layer.prefill(h, cache, block_table, start, cos, sin, chunk, plan, ready)
        return self.logits(h[-1:])

    @torch.inference_mode()
    def decode(self, token_ids: torch.Tensor, positions: torch.Tensor, kv_caches, step: DecodeStep,
               rotary: Rotary) -> torch.Tensor:
        """One step for B sequences: token_ids (B,) at positions (B,), both device tensors; returns logits (B, vocab).
        Makes no host synchronisation when rotary covers the positions already (CUDA graphs capture this)."""
        h = self.model.embed_tokens(token_ids)
        cos, sin = rotary.lookup(positions)
        for layer, cache in zip(self.model.layers, kv_caches):
            h = layer.decode(h, cache, step, cos, sin)
        return self.logits(h)
