"""Qwen3.5's hybrid decoder (`Qwen3_5ForCausalLM`): Gated DeltaNet linear-attention layers beside gated full attention.

Parameter names mirror Hugging Face's (`model.layers.N.linear_attn.in_proj_qkv.weight`, `...self_attn.q_proj...`).
A full-attention layer keeps per-token K/V in the paged cache as the dense model does (kvshare.engine.attention);
a linear-attention layer keeps, per sequence, a fixed-size recurrent state (value heads x key dim x value dim, fp32)
and the last `conv_kernel - 1` inputs of its short convolution, in the sequence's state slot (RecurrentState).

Invariants:
- A prefill starts at a multiple of STATE_BLOCK tokens (from 0, or from a state loaded at a chunk boundary), and the
  linear layers run in blocks aligned to absolute positions (kvshare.engine.linear_attention): the state after a
  prefill of [0, p) is bit-identical to the state a longer prefill passes through at p, so a state stored at a
  chunk boundary and loaded by another replica continues exactly as that replica's own prefill would have.
- `snapshot_at` positions get a copy of every linear layer's state after that position, packed as the pool stores
  them (kvshare.transfer.state.StateLayout), while the prefill runs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvshare.engine.attention import DecodeStep, decode_attention, prefill_attention, slot_indices, write_kv
from kvshare.engine.kv_quant import UNIT
from kvshare.engine.linear_attention import causal_conv, causal_conv_step, gated_delta_prefill, gated_delta_step
from kvshare.engine.model import MLP, Rotary
from kvshare.hf.config import ModelConfig

STATE_BLOCK = 64  # tokens per block of the linear layers' chunked form; chunk sizes of hybrid pools are multiples


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose weight is stored as an offset from one (Qwen3.5, Gemma), computed in fp32 throughout."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """The linear layer's output norm: RMSNorm (weight as is), then times silu(gate) in fp32."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (normed * F.silu(gate.float())).to(x.dtype)


def partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of each head of x (T, heads, D) by the half-split convention; the rest
    pass through unchanged."""
    rot = cos.shape[-1]
    x1, x2 = x[..., : rot // 2], x[..., rot // 2 : rot]
    rotated = x[..., :rot] * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated, x[..., rot:]), dim=-1)


@dataclass(frozen=True)
class RecurrentState:
    """One linear layer's state for a batch of sequences: views (or copies) of their slots."""

    recurrent: torch.Tensor  # (B, value_heads, key_dim, value_dim) fp32
    conv: torch.Tensor  # (B, conv_dim, conv_kernel - 1), the model's dtype


class GatedAttention(nn.Module):
    """Full attention with an output gate (q_proj yields each head's query and gate side by side), zero-centred q/k
    norms and partial rotary."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.head_dim**-0.5
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim * 2, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(c.head_dim, c.rms_norm_eps)
        self.kv_scales = UNIT

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x (T, hidden) -> roped q (T, heads, D), roped k and v (T, kv_heads, D), gate (T, heads * D)."""
        t = x.shape[0]
        q, gate = self.q_proj(x).view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q = self.q_norm(q)
        return partial_rope(q, cos, sin), partial_rope(k, cos, sin), v, gate.reshape(t, -1)


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer: projections, a short causal convolution over q|k|v, the gated delta rule,
    a gated norm and the output projection."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        lin = c.linear
        self.key_heads, self.value_heads = lin.num_key_heads, lin.num_value_heads
        self.key_dim, self.value_dim = lin.key_head_dim, lin.value_head_dim
        keys, values = lin.num_key_heads * lin.key_head_dim, lin.num_value_heads * lin.value_head_dim
        self.in_proj_qkv = nn.Linear(c.hidden_size, 2 * keys + values, bias=False)
        self.in_proj_z = nn.Linear(c.hidden_size, values, bias=False)
        self.in_proj_b = nn.Linear(c.hidden_size, lin.num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(c.hidden_size, lin.num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(lin.conv_dim, lin.conv_dim, lin.conv_kernel, groups=lin.conv_dim, bias=False,
                                padding=lin.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.empty(lin.num_value_heads))
        self.A_log = nn.Parameter(torch.empty(lin.num_value_heads))
        self.norm = GatedRMSNorm(lin.value_head_dim, c.rms_norm_eps)
        self.out_proj = nn.Linear(values, c.hidden_size, bias=False)
        self.splits = [keys, keys, values]
        self.rule = gated_delta_prefill  # or kvshare.engine.fla_rule.fla_prefill (HybridCausalLM.use_fla)

    def _inputs(self, x: torch.Tensor, mixed: torch.Tensor):
        """q, k (N, value_heads, key_dim), v (N, value_heads, value_dim), g, beta (N, value_heads) from the conv's
        output `mixed` (N, conv_dim); key heads are repeated to the value heads (GQA-style)."""
        n = x.shape[0]
        q, k, v = mixed.split(self.splits, dim=-1)
        repeat = self.value_heads // self.key_heads
        q = q.reshape(n, self.key_heads, self.key_dim).repeat_interleave(repeat, dim=1)
        k = k.reshape(n, self.key_heads, self.key_dim).repeat_interleave(repeat, dim=1)
        v = v.reshape(n, self.value_heads, self.value_dim)
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        return q, k, v, g, beta

    def _output(self, x: torch.Tensor, core: torch.Tensor) -> torch.Tensor:
        """The gated norm and output projection of the rule's output core (N, value_heads, value_dim)."""
        n = x.shape[0]
        z = self.in_proj_z(x).reshape(-1, self.value_dim)
        return self.out_proj(self.norm(core.reshape(-1, self.value_dim), z).reshape(n, -1))

    def prefill(self, x: torch.Tensor, state: RecurrentState, start: int,
                snapshot_at: Sequence[int]) -> tuple[torch.Tensor, dict[int, RecurrentState]]:
        """x (T, hidden), normed, at positions [start, start+T) of one sequence whose state (batch of 1) holds the
        state before `start`; updates it in place to the state after the last token. Returns the mixer's output
        (T, hidden) and the state after each position in snapshot_at."""
        mixed = self.in_proj_qkv(x)  # (T, conv_dim)
        kernel = self.conv1d.weight[:, 0, :]  # (conv_dim, K)
        keep = state.conv.shape[-1]
        # The conv state after position p: the last K-1 inputs before it (the slot's old state where they reach back)
        conv_at = {p: torch.cat((state.conv[0], mixed[max(0, p - start - keep) : p - start].t()), dim=-1)[:, -keep:]
                   for p in snapshot_at}  # (conv_dim, K-1) each; taken before the slot is overwritten
        conv_out, state.conv[0] = causal_conv(mixed, kernel, state.conv[0])
        del mixed
        q, k, v, g, beta = self._inputs(x, conv_out)
        del conv_out
        core, final, snaps = self.rule(q, k, v, g, beta, state.recurrent[0], start, STATE_BLOCK, snapshot_at)
        state.recurrent[0] = final
        snapshots = {p: RecurrentState(snaps[p][None], conv_at[p][None]) for p in snapshot_at}
        return self._output(x, core), snapshots

    def decode(self, x: torch.Tensor, state: RecurrentState) -> tuple[torch.Tensor, RecurrentState]:
        """One token for each of B sequences: x (B, hidden), normed; returns the output and the new states."""
        conv_out, conv = causal_conv_step(self.in_proj_qkv(x), self.conv1d.weight[:, 0, :], state.conv)
        q, k, v, g, beta = self._inputs(x, conv_out)
        core, recurrent = gated_delta_step(q, k, v, g, beta, state.recurrent)
        return self._output(x, core), RecurrentState(recurrent, conv)


class HybridDecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, kind: str):
        super().__init__()
        self.kind = kind
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(c)
        else:
            self.self_attn = GatedAttention(c)
        self.mlp = MLP(c)
        self.input_layernorm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps)

    def _mlp(self, h: torch.Tensor, chunk: int) -> None:
        for s in range(0, h.shape[0], chunk):
            h[s : s + chunk] += self.mlp(self.post_attention_layernorm(h[s : s + chunk]))

    def prefill_attention(self, h, cache, block_table, start, cos, sin, chunk, cache_ready=None) -> None:
        """A full-attention layer over positions [start, start+T), h (T, hidden) updated in place; cache_ready() runs
        before the layer's first read of its cache (a pool load in layer waves)."""
        attn, t = self.self_attn, h.shape[0]
        blocks, offsets = slot_indices(block_table, start, start + t, cache.shape[2])
        q = h.new_empty(t, attn.num_heads, attn.head_dim)  # reused for the attention output
        gate = h.new_empty(t, attn.num_heads * attn.head_dim)
        for s in range(0, t, chunk):
            e = min(t, s + chunk)
            q[s:e], k, v, gate[s:e] = attn.qkv(self.input_layernorm(h[s:e]), cos[s:e], sin[s:e])
            write_kv(cache, blocks[s:e], offsets[s:e], k, v, attn.kv_scales)
        if cache_ready is not None:
            cache_ready()
        prefill_attention(q, cache, block_table, start, attn.scale, attn.kv_scales, None)
        out = q.view(t, -1)
        for s in range(0, t, chunk):
            e = min(t, s + chunk)
            h[s:e] += attn.o_proj(out[s:e] * torch.sigmoid(gate[s:e]))
        self._mlp(h, chunk)

    def prefill_linear(self, h, state: RecurrentState, start: int, chunk: int,
                       snapshot_at: Sequence[int]) -> dict[int, RecurrentState]:
        """The mixer over [start, start+T) in pieces of `chunk` tokens (rounded down to STATE_BLOCK), each starting
        from the state the one before it ended with: a whole 256k span would need its projections, conv and q/k/v
        at once (~40 KiB a token for the 27B shape: 10 GiB, past what an H200 has beside the weights, run 31).
        Pieces start at multiples of STATE_BLOCK from a STATE_BLOCK-aligned start, where the conv and the gated
        delta rule are split-invariant bit for bit, so the pieces change no bits of the state; the residual of a
        piece is added after its own mixer, whose input is that piece's rows alone, so no piece reads another's
        update."""
        piece = max(STATE_BLOCK, chunk // STATE_BLOCK * STATE_BLOCK)
        snapshots: dict[int, RecurrentState] = {}
        for s in range(0, h.shape[0], piece):
            e = min(h.shape[0], s + piece)
            inside = [p for p in snapshot_at if start + s < p <= start + e]
            out, taken = self.linear_attn.prefill(self.input_layernorm(h[s:e]), state, start + s, inside)
            h[s:e] += out
            snapshots.update(taken)
        self._mlp(h, chunk)
        return snapshots

    def decode_attention(self, h, cache, step: DecodeStep, cos, sin) -> torch.Tensor:
        attn = self.self_attn
        q, k, v, gate = attn.qkv(self.input_layernorm(h), cos, sin)
        write_kv(cache, *step.slots, k, v, attn.kv_scales)
        out = decode_attention(q, cache, step, attn.scale, attn.kv_scales)
        h = h + attn.o_proj(out.flatten(1) * torch.sigmoid(gate))
        return h + self.mlp(self.post_attention_layernorm(h))

    def decode_linear(self, h, state: RecurrentState) -> tuple[torch.Tensor, RecurrentState]:
        out, new = self.linear_attn.decode(self.input_layernorm(h), state)
        h = h + out
        return h + self.mlp(self.post_attention_layernorm(h)), new


class HybridModel(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(HybridDecoderLayer(c, kind) for kind in c.linear.layer_types)
        self.norm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps)


class HybridCausalLM(nn.Module):
    """The whole hybrid model. `kv_caches` hold the full-attention layers only, in layer order; `states` (one
    RecurrentState per linear layer, in layer order) hold the sequences' slots."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = HybridModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def use_fla(self) -> None:
        """Linear layers' prefill through flash-linear-attention's kernels from now on (CUDA: engine/fla_rule.py)."""
        from kvshare.engine.fla_rule import fla_prefill

        for module in self.modules():
            if isinstance(module, GatedDeltaNet):
                module.rule = fla_prefill

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return F.linear(self.model.norm(h), weight).float()

    @torch.inference_mode()
    def prefill(self, token_ids, start, kv_caches, block_table, rotary: Rotary, chunk: int, states, snapshot_at=(),
                before_attention: Callable[[int], None] | None = None) -> tuple[torch.Tensor, list[dict]]:
        """Tokens at positions [start, start+T) of one sequence; `states[j]` its state in linear layer j (updated in
        place). Returns the last position's logits (1, vocab) and, per linear layer, its states at snapshot_at.
        before_attention(i) runs before attention layer i (an index into kv_caches) first reads its cache."""
        if start % STATE_BLOCK:
            raise ValueError(f"a hybrid prefill must start at a multiple of {STATE_BLOCK} tokens, not {start}")
        h = self.model.embed_tokens(token_ids)  # (T, hidden), updated in place layer by layer
        rotary.ensure(start + len(token_ids))
        cos, sin = rotary.lookup(torch.arange(start, start + len(token_ids), device=token_ids.device))
        caches, linear_states, snapshots = iter(kv_caches), iter(states), []
        attention_index = 0
        for layer in self.model.layers:
            if layer.kind == "linear_attention":
                snapshots.append(layer.prefill_linear(h, next(linear_states), start, chunk, snapshot_at))
                continue
            ready = None if before_attention is None else functools.partial(before_attention, attention_index)
            layer.prefill_attention(h, next(caches), block_table, start, cos, sin, chunk, ready)
            attention_index += 1
        return self.logits(h[-1:]), snapshots

    @torch.inference_mode()
    def decode(self, token_ids, positions, kv_caches, step: DecodeStep, rotary: Rotary,
               states: list[RecurrentState]) -> tuple[torch.Tensor, list[RecurrentState]]:
        """One step for B sequences; `states` gathered from their slots. Returns logits (B, vocab) and the new states
        (the caller writes them back to the slots)."""
        h = self.model.embed_tokens(token_ids)
        cos, sin = rotary.lookup(positions)
        caches, linear_states, new_states = iter(kv_caches), iter(states), []
        for layer in self.model.layers:
            if layer.kind == "linear_attention":
                h, new = layer.decode_linear(h, next(linear_states))
                new_states.append(new)
            else:
                h = layer.decode_attention(h, next(caches), step, cos, sin)
        return self.logits(h), new_states
