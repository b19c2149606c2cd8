"""Measuring the rates the cost model needs, and the Inputs record that says where each came from.

- Prefill: a short calibration against a replica URL: streamed completions of fresh random token ids (no cache can
  hit them) with one output token, `repeats` per length; TTFT at the client, so HTTP and the first step are in the
  curve's fixed term, as they are in every option's time.
- Load rate (pool -> engine): the replica's /metrics (kvshare_pool_load_bytes_total / kvshare_pool_load_seconds_total).
- L2 rate and hit rates: the pool's STATS (l2_promoted_bytes / l2_promote_seconds; hit and miss tokens), or the L2
  benchmark's JSON (its striped promote rate).
Every one of them can also be given by hand (kvshare advise --help), and the Inputs are written out beside the
report, so that a report can be made again from the same numbers.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import httpx
import msgspec
import numpy as np

from kvshare.costmodel import PrefillCurve, PrefillSample, Rates

TOKEN_IDS = (100, 1000)  # random prompt ids come from this range: inside every model's vocabulary (tiny: 1024)


class Inputs(msgspec.Struct, kw_only=True):
    """Everything a report is computed from; `sources` says where each number came from."""

    prefill: list[tuple[int, int, float]]  # (new tokens, cached tokens, seconds) per measured prefill
    kv_bytes_per_token: float
    load_gb_s: float
    l2_gb_s: float
    chunk_tokens: int = 256
    pool_fixed_s: float = 0.0
    l2_fixed_s: float = 0.0
    pool_hit_rate: float | None = None  # share of looked-up prompt tokens the pool had
    l2_hit_rate: float | None = None  # share of the pool's missed chunks that L2 supplied
    sources: dict[str, str] = {}

    def rates(self) -> Rates:
        samples = [PrefillSample(new, cached, seconds) for new, cached, seconds in self.prefill]
        return Rates(PrefillCurve.fit(samples), self.kv_bytes_per_token, self.load_gb_s, self.l2_gb_s,
                     self.chunk_tokens, self.pool_fixed_s, self.l2_fixed_s)


def load_inputs(path: Path) -> Inputs:
    return msgspec.json.decode(path.read_bytes(), type=Inputs)


def save_inputs(inputs: Inputs, path: Path) -> None:
    path.write_bytes(msgspec.json.format(msgspec.json.encode(inputs)) + b"\n")


def calibrate_prefill(base_url: str, lengths: list[int], repeats: int, seed: int = 0) -> list[tuple[int, int, float]]:
    """(n, 0, median TTFT) per length, from `repeats` fresh prompts of n random token ids each."""
    from kvshare.bench.client import completion_body, model_info, new_http_client, stream

    rng = np.random.default_rng(seed)
    samples = []
    with new_http_client() as http:
        model = model_info(http, base_url).name
        stream(http, base_url, "/v1/completions", completion_body(model, _fresh(rng, 16), 1))  # warm-up
        for n in lengths:
            times = []
            for _ in range(repeats):
                result = stream(http, base_url, "/v1/completions", completion_body(model, _fresh(rng, n), 1))
                if result.ttft_s is None:
                    raise RuntimeError(f"{base_url} streamed no token for a {n}-token prompt")
                times.append(result.ttft_s)
            samples.append((n, 0, statistics.median(times)))
    return samples


def _fresh(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(*TOKEN_IDS, n).tolist()


def load_rate_from_metrics(base_url: str) -> float | None:
    """GB/s of the replica's pool loads so far (None before its first load)."""
    response = httpx.get(f"{base_url}/metrics", timeout=10.0, trust_env=False)
    response.raise_for_status()
    values = _counters(response.text, ("kvshare_pool_load_bytes_total", "kvshare_pool_load_seconds_total"))
    nbytes, seconds = values.get("kvshare_pool_load_bytes_total", 0.0), values.get("kvshare_pool_load_seconds_total")
    return nbytes / seconds / 1e9 if seconds else None


def _counters(text: str, names: tuple[str, ...]) -> dict[str, float]:
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            found[name] = float(value)
    return found


class PoolFigures(msgspec.Struct):
    l2_gb_s: float | None
    pool_hit_rate: float | None
    l2_hit_rate: float | None


def pool_figures(address: str) -> PoolFigures:
    """The L2 promote rate and the hit rates a pool has seen (STATS)."""
    from kvshare.pool.client import PoolClient

    with PoolClient.connect(address, map_arena=False) as client:
        stats = client.stats()
    looked_up = stats.hit_tokens + stats.miss_tokens
    rate = stats.l2_promoted_bytes / stats.l2_promote_seconds / 1e9 if stats.l2_promote_seconds else None
    return PoolFigures(rate, stats.hit_tokens / looked_up if looked_up else None,
                       stats.l2_hits / stats.miss_chunks if stats.miss_chunks else None)


def l2_rate_from_bench(path: Path, backend: str = "standalone") -> float:
    """The striped promote rate a `kvshare bench l2` JSON reports for `backend`."""
    result = msgspec.json.decode(path.read_bytes())
    for entry in result["backends"]:
        if entry["name"].startswith(backend):
            return float(next(p["promote_gb_s"] for p in entry["paths"] if p["path"] == "striped"))
    raise ValueError(f"{path} has no backend named {backend!r}")


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int | None = None) -> float:
    """layers x KV heads x head dim x 2 (K and V) x bytes per value, from a Hugging Face config.json."""
    config = msgspec.json.decode((model_dir / "config.json").read_bytes())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    size = dtype_bytes or {"float32": 4, "bfloat16": 2, "float16": 2}.get(config.get("torch_dtype", "bfloat16"), 2)
    return float(config["num_hidden_layers"] * heads * head_dim * 2 * size)


def fixed_cost(measured: list[tuple[int, int, float]], rates: Rates) -> float:
    """A pool hit's fixed cost: the median of measured ON time minus the model's bytes and tail for it, over
    (prompt tokens, hit tokens, seconds) samples; never below 0."""
    prefill, excess = rates.prefill, []
    for n, hit, seconds in measured:
        loading = hit * rates.kv_bytes_per_token / (rates.load_gb_s * 1e9)
        excess.append(seconds - loading - prefill.seconds(n - hit, hit))
    return max(0.0, statistics.median(excess)) if excess else 0.0
