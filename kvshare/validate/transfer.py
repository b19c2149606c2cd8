"""`kvshare validate transfer`: byte-exact store/load through a real pool, with controlled stream races on CUDA.

Each trial stores chunks of random KV through RESERVE/COMMIT, LOOKUPs them, loads them into *different*, poisoned
blocks (the first block of each chunk marked SKIP must stay poisoned) and compares every byte against an
independent reference packing, plus the checksums. On CUDA each trial races on purpose:
- store: the producing stream sleeps (`torch.cuda._sleep`) and then writes fresh KV into the source blocks; store()
  is called at once. Safe ordering must pack the fresh bytes; ordering="none" packs stale ones.
- load: the side streams are delayed and the consumer copies the destination blocks right after load() returns.
  Safe ordering must show the loaded bytes; ordering="none" shows poison. Every other trial loads in layer waves
  (the reference engine's default) and the consumer copies each layer right after wait_layer(layer): the same
  checks, per layer; on a CPU this races the loader thread (transfers in waves are asynchronous there too).
Passing means 0 mismatches with ordering="stream" and, on CUDA, mismatches detected with ordering="none".
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from kvshare import checksum
from kvshare.keys import Namespace, chunk_keys, token_bytes
from kvshare.transfer import arena_pages
from kvshare.transfer.jobs import SKIP, LoadJob, StoreJob
from kvshare.transfer.layout import KVLayout
from kvshare.transfer.transfer import TransferOptions, make_transfer

POISON = 0xA5


@dataclass(frozen=True)
class ValidateConfig:
    device: str = "cpu"
    trials: int = 20
    chunks_per_trial: int = 4
    chunk_tokens: int = 64
    page_size: int = 44 << 10  # not a multiple of the unit: chunks end mid-page and pages have unused tails
    sleep_cycles: int = 50_000_000  # ~25 ms on an H200: far longer than one trial's copies
    pool: str | None = None  # address of a running pool; None starts one
    seed: int = 0


@dataclass
class ModeResult:
    ordering: str
    trials: int = 0
    store_mismatches: int = 0  # chunks whose stored bytes differ from the reference packing
    load_mismatches: int = 0  # chunks whose destination blocks differ after load (as the consumer saw them)
    checksum_mismatches: int = 0
    skip_violations: int = 0  # SKIP blocks that were written


@dataclass
class ValidateReport:
    device: str
    layout: str
    config: dict
    modes: list[ModeResult] = field(default_factory=list)
    passed: bool = False
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def reference_layout(device: str) -> KVLayout:
    blocks = 128
    return KVLayout(num_layers=4, num_blocks=blocks, block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


def run(config: ValidateConfig) -> ValidateReport:
    layout = reference_layout(config.device)
    report = ValidateReport(config.device, layout.describe(), asdict(config))
    with _pool(config, layout) as client:
        modes = ["stream", "none"] if config.device == "cuda" else ["stream"]
        for ordering in modes:
            report.modes.append(_run_mode(config, layout, client, ordering))
    safe = report.modes[0]
    report.passed = not (safe.store_mismatches or safe.load_mismatches or safe.checksum_mismatches
                         or safe.skip_violations)
    if config.device == "cuda":
        unsafe = report.modes[1]
        report.passed &= unsafe.store_mismatches > 0 and unsafe.load_mismatches > 0
    else:
        report.notes.append("CPU: no streams, so no unsafe mode to show; loads in layer waves run on a loader thread "
                            "and are checked layer by layer after each wait")
    return report


@contextlib.contextmanager
def _pool(config: ValidateConfig, layout: KVLayout):
    from kvshare.pool import PoolClient

    if config.pool:
        with PoolClient.connect(config.pool) as client:
            yield client
        return
    from kvshare.pool.testing import start_pool

    chunk_pages = layout.pages_needed(config.chunk_tokens, config.page_size)
    size = 4 * config.chunks_per_trial * chunk_pages * config.page_size
    with start_pool(size, page_size=config.page_size, check_integrity=False) as (address, _process):
        with PoolClient.connect(address) as client:
            yield client


class _Trial:
    """Everything one trial needs: the engine's KV (one allocation, a view per layer) and the transfer."""

    def __init__(self, config: ValidateConfig, layout: KVLayout, client, ordering: str):
        self.config, self.layout, self.client = config, layout, client
        shape = (layout.num_layers, *layout.tensor_shape)
        self.kv = torch.zeros(shape, dtype=layout.dtype, device=config.device)
        self.kv_bytes = self.kv.view(torch.uint8).view(layout.num_layers, layout.num_blocks, layout.block_bytes)
        delay = config.sleep_cycles if config.device == "cuda" else 0
        options = TransferOptions(ordering=ordering, side_delay_cycles=delay)
        self.transfer = make_transfer(layout, list(self.kv.unbind(0)), arena_pages(client), options=options)
        self.namespace = Namespace("validate-transfer", "bfloat16", layout.layout_id(), config.chunk_tokens).key
        client.hello(self.namespace, "kvshare validate transfer")
        self.rng = np.random.default_rng(config.seed)


def _run_mode(config: ValidateConfig, layout: KVLayout, client, ordering: str) -> ModeResult:
    trial = _Trial(config, layout, client, ordering)
    result = ModeResult(ordering)
    for _ in range(config.trials):
        _one_trial(trial, result)
        result.trials += 1
    return result


def _one_trial(t: _Trial, result: ModeResult) -> None:
    layout, config, rng = t.layout, t.config, t.rng
    bpc = layout.blocks_per_chunk(config.chunk_tokens)
    n = config.chunks_per_trial
    blocks = rng.permutation(layout.num_blocks)[: 2 * n * bpc].reshape(2, n, bpc)
    sources, targets = blocks[0], blocks[1]
    tokens = rng.integers(0, 2**31, size=n * config.chunk_tokens)
    keys = chunk_keys(t.namespace, tokens, config.chunk_tokens)
    token_chunks = [token_bytes(tokens[i * config.chunk_tokens : (i + 1) * config.chunk_tokens]) for i in range(n)]
    _fill_random(t, rng)

    # ---- store, racing the producer -----------------------------------------------------------------------------
    from kvshare.pool import NewChunk

    nbytes = layout.chunk_nbytes(config.chunk_tokens, t.client.page_size)
    parents = [t.namespace] + keys[:-1]
    reservation = t.client.reserve(t.namespace, [NewChunk(k, p, tb, nbytes) for k, p, tb in
                                                 zip(keys, parents, token_chunks)])
    refs = reservation.chunks
    fresh = torch.randint(0, 256, (layout.num_layers, n * bpc, layout.block_bytes), dtype=torch.uint8,
                          device=config.device)
    index = torch.from_numpy(sources.reshape(-1)).to(config.device)
    if config.device == "cuda":
        torch.cuda._sleep(config.sleep_cycles)  # the producer is late: the KV below is written ~25 ms from now
    t.kv_bytes.index_copy_(1, index, fresh)  # the kernel that writes the KV
    handle = t.transfer.store([StoreJob(sources[i].tolist(), refs[i].pages) for i in range(n)])
    handle.wait()
    checksums = handle.checksums()  # from the bytes the store wrote (CUDA: its staging slots, on the GPU)
    _synchronize(config.device)
    expected = [_reference_pack(t.kv_bytes, sources[i]) for i in range(n)]
    stored = [_stored_bytes(t, refs[i].pages, nbytes) for i in range(n)]
    for i in range(n):
        result.store_mismatches += int(not np.array_equal(stored[i], expected[i]))
        result.checksum_mismatches += int(checksums[i] != checksum.checksum(_extent(t, stored[i])))
        result.checksum_mismatches += int(checksums[i] != t.transfer.checksum(refs[i].pages, nbytes))  # the pool's view
    t.client.commit(reservation.lease, checksums)

    # ---- load into poisoned, different blocks, racing the consumer -----------------------------------------------
    found = t.client.lookup(t.namespace, keys, token_chunks)
    try:
        t.kv_bytes[:, torch.from_numpy(targets.reshape(-1)).to(config.device)] = POISON
        jobs = []
        for i, ref in enumerate(found.chunks):
            ids = targets[i].copy()
            ids[0] = SKIP  # "already present": must stay poisoned
            jobs.append(LoadJob(ref.pages, ids.tolist()))
        waves = 1 if result.trials % 2 == 0 else layout.num_layers  # every other trial in layer waves
        loaded = t.transfer.load(jobs, checksums=True, waves=waves)
        seen = _consumer_reads(t, loaded, torch.from_numpy(targets.reshape(-1)).to(config.device))
        _synchronize(config.device)
        result.checksum_mismatches += sum(a != ref.checksum for a, ref in zip(loaded.checksums(), found.chunks))
        seen = seen.cpu().numpy().reshape(layout.num_layers, n, bpc, layout.block_bytes)
        for i in range(n):  # against what the pool holds, so a stale store cannot pass for a load race
            want = stored[i].reshape(layout.num_layers, bpc, layout.block_bytes)
            result.load_mismatches += int(not np.array_equal(seen[:, i, 1:], want[:, 1:]))
            result.skip_violations += int(not np.all(seen[:, i, 0] == POISON))
    finally:
        if found.lease:
            t.client.release(found.lease)


def _consumer_reads(t: _Trial, loaded, targets: torch.Tensor) -> torch.Tensor:
    """What a consumer copies out of the target blocks at once, each layer right after wait_layer of that layer (a
    load in one wave ordered everything when it returned: those waits do nothing)."""
    layers = []
    for layer in range(t.layout.num_layers):
        loaded.wait_layer(layer)
        layers.append(t.kv_bytes[layer, targets].clone())
    return torch.stack(layers)


def _fill_random(t: _Trial, rng: np.random.Generator) -> None:
    generator = torch.Generator(device=t.config.device).manual_seed(int(rng.integers(2**31)))
    t.kv_bytes.random_(0, 256, generator=generator)


def _reference_pack(kv_bytes: torch.Tensor, block_ids: np.ndarray) -> np.ndarray:
    """The packing rule written out independently of the transfer code: layer-major units, K then V each."""
    index = torch.from_numpy(np.asarray(block_ids)).to(kv_bytes.device)
    return kv_bytes[:, index].reshape(-1).cpu().numpy()


def _extent(t: _Trial, units: np.ndarray) -> np.ndarray:
    """A chunk's extent as the checksum reads it, built from its packed units: each page's units, zeros to the end of
    every page but the last (the store keeps page tails zero)."""
    used, page_size = t.layout.units_per_page(t.client.page_size) * t.layout.block_bytes, t.client.page_size
    pieces = [units[k : k + used] for k in range(0, len(units), used)]
    return np.concatenate([np.pad(p, (0, page_size - len(p))) for p in pieces[:-1]] + pieces[-1:])


def _stored_bytes(t: _Trial, pages: list[int], nbytes: int) -> np.ndarray:
    """The chunk's units read back from the arena, page tails skipped."""
    used = t.layout.units_per_page(t.client.page_size) * t.layout.block_bytes
    arena = t.client.pages
    parts = [arena[p, : min(used, nbytes - k * t.client.page_size)] for k, p in enumerate(pages)]
    return np.concatenate(parts)


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
