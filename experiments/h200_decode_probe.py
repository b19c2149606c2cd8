"""Does a pool store slow the decode it runs beside? One engine, one GPU, decode time per token of fresh prompts:

    PYTHONPATH=/tmp/site:. python3 experiments/h200_decode_probe.py --length 32768 --out $OUT

On two H200s, fixed-placement sessions decoded 0.6-2.7 s slower per 32-token answer with the pool ON while TTFT was
unchanged (docs/results/h200x2/NOTES.md). Each condition sends a fresh prompt and times every streamed token:
- `no pool`: no connector;
- `store`: the connector stores the prompt while the answer decodes (copies on side streams, then hashing, COMMIT);
- `store, no hashing`: the same with the commit's checksums replaced by zeros, which isolates the hashing threads;
- `store, 1 hash thread`: hashing on one thread instead of up to 16 (do many hashing threads starve the engine
  thread of the GIL?);
- `already stored`: the connector attached but the prompt's chunks in the pool already (no copy, no hash).
The store conditions run twice, interleaved (noise shows as disagreement between the two). Prints a table (median
and spread of ms per decode token, the engine thread's time inside the store call, store seconds) and writes
decode_probe.json with every step's time.
`--preset small --device cpu --dtype float32 --length 512` is a smoke run of the script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from kvshare.connector import ConnectorConfig
from kvshare.engine.api import GenerationRequest, SamplingParams, TokenEvent
from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine
from kvshare.engine.make_model import make_model
from kvshare.engine.pool_connector import PoolConnector
from kvshare.pool.testing import start_pool
from kvshare.transfer import checksum


def token_times(engine: Engine, request_id: str, prompt: tuple[int, ...], tokens: int) -> list[float]:
    """perf_counter() at the submit and at each streamed token of one request."""
    times, done = [time.perf_counter()], threading.Event()

    def on_event(event: TokenEvent) -> None:
        if event.token_id is not None:
            times.append(time.perf_counter())
        if event.finished:
            done.set()

    engine.submit(GenerationRequest(request_id, prompt, SamplingParams(max_tokens=tokens, ignore_eos=True)), on_event)
    if not done.wait(900):
        raise TimeoutError(f"{request_id} did not finish in 900 s")
    return times


def fresh_prompt(length: int, vocab: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist())


def measure(name: str, engine: Engine, prompt: tuple[int, ...], tokens: int) -> dict:
    stats = engine.connector.stats if engine.connector else None
    stored_before = stats.store_seconds if stats else 0.0
    calls: list[float] = []  # seconds the engine thread spent inside each store call (it decodes nothing meanwhile)
    if engine.pool:
        store = engine.pool.store

        def timed_store(seq, num_tokens):
            start = time.perf_counter()
            try:
                return store(seq, num_tokens)
            finally:
                calls.append(time.perf_counter() - start)

        engine.pool.store = timed_store
    try:
        times = token_times(engine, name, prompt, tokens)
    finally:
        if engine.pool:
            del engine.pool.store  # back to the class's method
    if engine.connector:
        engine.connector.core.flush(300)
    steps = [b - a for a, b in zip(times[1:], times[2:])]  # decode steps: first token to each next one
    median_ms = 1e3 * statistics.median(steps)
    print(f"{name}: median {median_ms:.1f} ms/token, store calls {1e3 * sum(calls):.1f} ms",
          flush=True)  # a partial result survives a cut run
    return dict(condition=name, prompt_tokens=len(prompt), ttft_s=times[1] - times[0], decode_ms_median=median_ms,
                decode_ms_min=1e3 * min(steps), decode_ms_max=1e3 * max(steps), decode_s_total=times[-1] - times[1],
                store_s=(stats.store_seconds - stored_before) if stats else 0.0,
                store_call_ms_max=1e3 * max(calls, default=0.0), store_call_ms_total=1e3 * sum(calls),
                steps_ms=[round(1e3 * step, 2) for step in steps])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2.5-32b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--length", type=int, default=32768, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=64, help="answer tokens (decode steps + 1)")
    parser.add_argument("--kv-cache-gib", type=float, default=40.0)
    parser.add_argument("--pool-size", default="64GiB", help="holds every stored prompt (six at --length)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out/decode_probe")))
    args = parser.parse_args()
    model = str(make_model(args.preset, Path(tempfile.mkdtemp()) / args.preset))
    engine = Engine(EngineConfig(model=model, load_format="dummy", device=args.device, dtype=args.dtype,
                                 kv_cache_memory=int(args.kv_cache_gib * 2**30), max_model_len=args.length + 1024))
    vocab = engine.model_config.vocab_size
    rows = []
    try:
        token_times(engine, "warm-up", fresh_prompt(256, vocab, 0), 4)
        rows.append(measure("no pool", engine, fresh_prompt(args.length, vocab, 1), args.tokens))
        with start_pool(args.pool_size, check_integrity=False) as (address, _):
            engine.set_connector(PoolConnector.for_engine(engine, ConnectorConfig(address=address)))
            token_times(engine, "warm-up pool", fresh_prompt(256, vocab, 2), 4)
            stored = fresh_prompt(args.length, vocab, 3)
            transfer = engine.connector.core._attached[1]
            patches = {"store": contextlib.nullcontext, "store, no hashing": lambda: _zero_checksums(transfer),
                       "store, 1 hash thread": _one_hash_thread}
            for i, name in enumerate(list(patches) * 2):  # each twice, interleaved: repeats that disagree are noise
                with patches[name]():
                    rows.append(measure(name, engine, stored if i == 0 else fresh_prompt(args.length, vocab, 3 + i),
                                        args.tokens))
            # The same prompt again, as another request: its chunks are in the pool, so nothing is copied or hashed
            # (its prefix also comes from the engine's own cache: the decode is what is compared).
            rows.append(measure("already stored", engine, stored, args.tokens))
            engine.connector.close()
            engine.set_connector(None)
    finally:
        engine.shutdown()
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{device}, {args.preset}, prompt {args.length} tokens, {args.tokens - 1} decode steps")
    print(f"{'condition':<22} {'TTFT s':>7} {'ms/token med':>12} {'min':>6} {'max':>6} {'decode s':>8} "
          f"{'store call ms max/total':>23} {'store s':>7}")
    for r in rows:
        print(f"{r['condition']:<22} {r['ttft_s']:7.3f} {r['decode_ms_median']:12.1f} {r['decode_ms_min']:6.1f} "
              f"{r['decode_ms_max']:6.1f} {r['decode_s_total']:8.3f} "
              f"{r['store_call_ms_max']:11.1f}/{r['store_call_ms_total']:<11.1f} {r['store_s']:7.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_probe.json").write_text(json.dumps(dict(device=device, preset=args.preset,
                                                                length=args.length, rows=rows), indent=2))


@contextlib.contextmanager
def _zero_checksums(transfer):
    """COMMIT with zero checksums: the store without its hashing threads."""
    real = transfer.start_checksums
    transfer.start_checksums = lambda chunks: [_done(0) for _ in chunks]
    try:
        yield
    finally:
        transfer.start_checksums = real


@contextlib.contextmanager
def _one_hash_thread():
    """Hash on one thread instead of up to 16 (do many hashing threads starve the engine thread of the GIL?)."""
    real, one = checksum._hashers, ThreadPoolExecutor(1, thread_name_prefix="probe-hash")
    checksum._hashers = lambda: one
    try:
        yield
    finally:
        checksum._hashers = real
        one.shutdown()


def _done(value: int) -> Future:
    """A finished future holding `value`, as start_checksums hands back."""
    future: Future = Future()
    future.set_result(value)
    return future


if __name__ == "__main__":
    main()
