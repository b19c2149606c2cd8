"""fp8 KV cache (`kvshare serve --kv-cache-dtype fp8`): e4m3 with per-tensor scales, read back by attention; the pool
moves its pages unchanged, fp8 and model-dtype replicas never share, and a cross-replica hit gives exactly what a
local prefix hit and cache OFF give (CPU, fp32 compute)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from kvshare.connector import ConnectorConfig
from kvshare.engine.api import GenerationRequest, SamplingParams
from kvshare.engine.attention import gather_kv, prefill_attention, write_kv
from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine, generate
from kvshare.engine.kv_quant import KVScales, from_cache, to_cache
from kvshare.engine.pool_connector import PoolConnector
from kvshare.pool.client import read_stats
from kvshare.pool.testing import start_pool

FP8 = torch.float8_e4m3fn
CHUNK = 32
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def test_values_saturate_and_scale_as_vllm_does():
    x = torch.tensor([1000.0, -1000.0, 1.0, 0.3, -2.5])
    stored = to_cache(x, FP8, 1.0)
    assert stored.dtype == FP8 and from_cache(stored, torch.float32, 1.0).tolist() == [448, -448, 1.0, 0.3125, -2.5]
    halved = to_cache(x, FP8, 2.0)  # stored = x / scale, read = stored * scale
    assert from_cache(halved, torch.float32, 2.0).tolist() == [896, -896, 1.0, 0.3125, -2.5]
    assert to_cache(x, torch.float32, 2.0) is x and from_cache(x, torch.bfloat16, 2.0) is x  # unquantized: as is


def test_attention_reads_the_dequantized_cache():
    """An fp8 cache with scales (0.5, 4): what is gathered is fp8(k / 0.5) * 0.5, and prefill attention over it
    equals attention over an fp32 cache holding those dequantized values."""
    scales = KVScales(0.5, 4.0)
    generator = torch.Generator().manual_seed(0)
    k, v, q = (torch.randn(40, 2, 8, generator=generator) * 3 for _ in range(3))
    q = torch.randn(40, 4, 8, generator=generator)
    table = torch.tensor([3, 0, 2])
    fp8_cache = torch.zeros(4, 2, 16, 2, 8, dtype=FP8)
    blocks, offsets = table[torch.arange(40) // 16], torch.arange(40) % 16
    write_kv(fp8_cache, blocks, offsets, k, v, scales)
    got_k, got_v = gather_kv(fp8_cache, table, 40, slice(0, 2), torch.float32, scales)
    want_k = to_cache(k, FP8, 0.5).float() * 0.5
    want_v = to_cache(v, FP8, 4.0).float() * 4.0
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert not torch.equal(got_k, k)  # quantization did happen
    float_cache = torch.zeros(4, 2, 16, 2, 8)
    write_kv(float_cache, blocks, offsets, want_k, want_v)
    for start in (0, 30):  # the square form and the lower-right form (a short tail over cached context)
        out_fp8, out_float = q[start:].clone(), q[start:].clone()
        prefill_attention(out_fp8, fp8_cache, table, start, 0.35, scales)
        prefill_attention(out_float, float_cache, table, start, 0.35)
        assert torch.equal(out_fp8, out_float)


def test_checkpoint_scales_are_read_and_enter_the_identity(tiny_model, tmp_path):
    folder = tmp_path / "scaled"
    shutil.copytree(tiny_model, folder)
    plain = Engine(EngineConfig(model=str(folder), num_blocks=32, kv_cache_dtype="fp8"), start=False)
    save_file({"model.layers.1.self_attn.k_scale": torch.tensor(0.25), "model.layers.1.self_attn.v_scale":
               torch.tensor([3.0])}, str(folder / "kv_scales.safetensors"))
    scaled = Engine(EngineConfig(model=str(folder), num_blocks=32, kv_cache_dtype="fp8"), start=False)
    layers = [layer.self_attn.kv_scales for layer in scaled.runner.model.model.layers]
    assert layers == [KVScales(1.0, 1.0), KVScales(0.25, 3.0)]  # 1.0 where the checkpoint has none (vLLM's default)
    assert scaled.kv_caches[0].dtype == FP8
    assert plain.model_fingerprint != scaled.model_fingerprint  # other scales: other fp8 bytes for the same KV


@pytest.fixture
def engines(tiny_model):
    """make(dtype, kv_cache_dtype) -> an Engine on the tiny model, all shut down after the test."""
    made = []

    def make(dtype="float32", kv="fp8"):
        engine = Engine(EngineConfig(model=str(tiny_model), dtype=dtype, kv_cache_dtype=kv, max_model_len=512,
                                     num_blocks=128))
        made.append(engine)
        assert os.environ.get("TRITON_INTERPRET") != "1" or engine.runner.paged  # see test_paged_interpreter.py
        return engine

    yield make
    for engine in made:
        if engine.connector is not None:
            engine.connector.close()
        engine.shutdown()


def attach(engine: Engine, address: str) -> PoolConnector:
    connector = PoolConnector.for_engine(engine, ConnectorConfig(address=address, chunk_tokens=CHUNK))
    engine.set_connector(connector)
    return connector


def run(engine: Engine, prompt: list[int], rid: str = "r"):
    (result,) = generate(engine, [GenerationRequest(f"{rid}-{len(prompt)}-{prompt[0]}", tuple(prompt), GREEDY)],
                         timeout=120)
    assert result.finished is not None and result.finished.finish_reason != "error", result.finished
    return result.token_ids, result.finished.usage


def prompt_of(length: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 1000 + 3 for i in range(length)]


def test_fp8_cross_replica_equals_a_local_prefix_hit_and_cache_off(engines):
    off, a, b = engines(), engines(), engines()
    assert a.kv_caches[0].dtype == FP8
    with start_pool("8MiB", page_size="64KiB") as (address, _):
        attach(a, address)
        connector_b = attach(b, address)
        for length in (70, 129):
            prompt = prompt_of(length, seed=length)
            reference, _ = run(off, prompt)
            stored, _ = run(a, prompt)
            a.connector.core.flush()
            local, local_usage = run(a, prompt, rid="again")  # A's own prefix cache
            cross, cross_usage = run(b, prompt)  # B has never seen it: only the pool's fp8 pages can answer
            assert local_usage.local_hit_tokens == (length - 1) // 16 * 16 and local_usage.pool_hit_tokens == 0
            assert cross_usage.pool_hit_tokens == (length - 1) // 16 * 16 and cross_usage.local_hit_tokens == 0
            assert cross == local == stored == reference
        assert connector_b.stats.loads == 2 and connector_b.stats.load_failures == 0


def test_fp8_and_model_dtype_replicas_never_share(engines):
    plain, fp8, other_fp8 = engines("bfloat16", "auto"), engines("bfloat16", "fp8"), engines("bfloat16", "fp8")
    assert plain.model_fingerprint == fp8.model_fingerprint  # one model: only the KV dtype tells them apart
    with start_pool("8MiB", page_size="64KiB") as (address, _):
        spaces = [attach(engine, address).core.namespace() for engine in (plain, fp8, other_fp8)]
        assert spaces[0].dtype == "bfloat16" and spaces[1].dtype == "bfloat16/kv=float8_e4m3fn"
        assert spaces[0].layout_id != spaces[1].layout_id and spaces[1] == spaces[2]
        prompt = prompt_of(100, seed=3)
        run(plain, prompt)
        plain.connector.core.flush()
        before = read_stats(address).hit_tokens
        _, usage = run(fp8, prompt)
        assert usage.pool_hit_tokens == 0 and read_stats(address).hit_tokens == before  # not even a pool-side hit
        fp8.connector.core.flush()
        _, usage = run(other_fp8, prompt)  # the fp8 replica's own store is there for fp8 replicas
        assert usage.pool_hit_tokens == 96


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp8_cross_replica_equals_a_local_prefix_hit_on_cuda(tiny_model):
    """bf16 compute over an fp8 cache on the GPU: B's pool hit gives the tokens A's own prefix hit gives (the same
    kernels over the same fp8 bytes; cache OFF may differ by bf16 kernel rounding, so it is not compared)."""
    made = [Engine(EngineConfig(model=str(tiny_model), device="cuda", dtype="bfloat16", kv_cache_dtype="fp8",
                                max_model_len=512, num_blocks=128)) for _ in range(2)]
    a, b = made
    try:
        assert a.kv_caches[0].dtype == FP8 and a.kv_caches[0].is_cuda
        with start_pool("8MiB", page_size="64KiB") as (address, _):
            attach(a, address)
            attach(b, address)
            prompt = prompt_of(161, seed=9)
            run(a, prompt)
            a.connector.core.flush()
            local, local_usage = run(a, prompt, rid="again")
            cross, cross_usage = run(b, prompt)
            assert local_usage.local_hit_tokens == cross_usage.pool_hit_tokens == 160
            assert cross == local
            assert b.connector.stats.load_failures == 0
    finally:
        for engine in made:
            if engine.connector is not None:
                engine.connector.close()
            engine.shutdown()
