"""`Transfer`, the interface every path implements, and `make_transfer`, which picks the CPU or CUDA path."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Literal, Sequence

import torch

from kvshare.transfer.blocks import BlockSpace, build_block_space
from kvshare.transfer.checksum import arena_checksum, start_checksums
from kvshare.transfer.hostmem import DEFAULT_PIECE_BYTES, DEFAULT_THREADS, unregister_pages
from kvshare.transfer.jobs import ChunkPlan, LoadJob, StoreJob, TransferHandle, plan
from kvshare.transfer.layout import KVLayout
from kvshare.transfer.waves import WavePlan, plan_waves

if TYPE_CHECKING:
    from kvshare.pool.client import PoolClient

Ordering = Literal["stream", "none"]
ChecksumsOn = Literal["device", "host"]


@dataclass(frozen=True)
class TransferOptions:
    """Tuning and test knobs. Defaults are what production uses.

    ordering: "stream" orders every copy after the work it depends on (I4, I5). "none" drops those waits: an
      UNSAFE mode that exists only so `kvshare validate transfer` can show its race test detects the bug.
    staging_bytes / staging_slots: CUDA staging ring, rounded to whole pages (at least one page a slot).
    side_delay_cycles: validation only: `torch.cuda._sleep` this long on the copy stream before each load (and
      each wave of a layered load), so a consumer that does not wait for the load is caught reading poison.
    checksums: where a CUDA transfer computes chunk checksums. "device": on the GPU from the staging slots, beside
      the copies (a load's verification then costs about one slot's hash after its last copy). "host": on host
      threads from the arena, after a store's copies and while a load's run (the design before; CPU transfers
      always do this, and a CUDA transfer falls back to it for layouts whose units are not whole 8-byte words).
    register_piece_bytes / register_threads / register_ahead: CUDA only: the arena is registered for DMA in pieces
      of at most this many bytes (whole pages), by this many background threads from the start (ahead) or only
      as transfers first touch them; a transfer waits only for its own pieces (kvshare.transfer.hostmem).
    stream_priority: CUDA only: "high" creates the side streams (gather, copy, hash) at the device's highest
      priority. The GPU's block scheduler then dispatches their small kernels ahead of the pending blocks of the
      caller's long kernels, where with "normal" they may wait for SMs to free up. Measured on the H200 (stores
      overlapping GEMMs, experiments/h200_store_under_load.py): no difference, the stores kept up at both, so the
      default is "normal". Ordering is by events either way; priority changes only when queued work runs.
    unit_kernel: CUDA only: where the KV layers are separate allocations (vLLM 0.26's tensor per layer), a slot's
      units move by one Triton kernel (kvshare.transfer.unit_kernel) instead of an index op per layer; the same
      bytes on the same streams. False keeps the torch form (to compare them, experiments/h200_load_layers.py).
    """

    ordering: Ordering = "stream"
    staging_bytes: int = 64 << 20
    staging_slots: int = 4
    side_delay_cycles: int = 0
    checksums: ChecksumsOn = "device"
    register_piece_bytes: int = DEFAULT_PIECE_BYTES
    register_threads: int = DEFAULT_THREADS
    register_ahead: bool = True
    stream_priority: str = "normal"
    unit_kernel: bool = True

    def __post_init__(self):
        if self.ordering not in ("stream", "none"):
            raise ValueError(f"ordering must be 'stream' or 'none' (unsafe, validation only), got {self.ordering!r}")
        if self.stream_priority not in ("normal", "high"):
            raise ValueError(f"stream_priority must be 'normal' or 'high', got {self.stream_priority!r}")
        if self.checksums not in ("device", "host"):
            raise ValueError(f"checksums must be computed on 'device' or 'host', got {self.checksums!r}")
        if self.staging_slots < 2:
            raise ValueError("staging_slots must be >= 2 so that gathers overlap copies")
        if self.register_piece_bytes <= 0 or self.register_threads < 1:
            raise ValueError("register_piece_bytes must be positive and register_threads >= 1")


class Transfer:
    """Moves chunks between one engine's KV tensors and one arena's pages. Not thread-safe: one caller thread."""

    def __init__(self, space: BlockSpace, pages: torch.Tensor, options: TransferOptions):
        if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.device.type != "cpu":
            raise ValueError(f"pages must be a host uint8 [num_pages, page_size] tensor, got {pages.dtype} "
                             f"{tuple(pages.shape)} on {pages.device}")
        if pages.stride() != (pages.shape[1], 1):
            raise ValueError("pages must be row-contiguous (a view of the arena: arena_pages(client))")
        self.space, self.layout, self.pages, self.options = space, space.layout, pages, options
        self.page_size, self.num_pages = pages.shape[1], pages.shape[0]
        self._arena = pages.numpy()  # the same memory, for the host checksum (numpy)
        self.units_per_page = self.layout.units_per_page(self.page_size)  # refuses a page smaller than a block

    def store(self, jobs: Sequence[StoreJob]) -> TransferHandle:
        """Pack each job's blocks into its pages. Ordered after all work already queued on the current stream.

        The handle's checksums() are computed from the bytes written. Page tails (bytes past a page's last unit) are
        zeroed here, so a chunk's whole extent is a function of its units: the pool, which does not know where the
        units end, hashes every byte and gets the checksum a GPU computes from the units alone."""
        plans = plan(self.space, jobs, self.page_size, self.num_pages, loading=False)
        self._zero_tails(plans)
        return self._store(plans)

    def load(self, jobs: Sequence[LoadJob], checksums: bool = False, waves: int = 1) -> TransferHandle:
        """Unpack each job's pages into its blocks; every later kernel on the current stream sees the result.
        checksums=True: the handle's checksums() are computed from the bytes read (to verify against the writer's).

        waves > 1: move the pages layer wave by layer wave (kvshare.transfer.waves) and return while they move, so
        the caller can compute on layers that have landed: then I5 holds per layer, after handle.wait_layer(l) (for
        the blocks of layer l) and after handle.wait() (for all); nothing is ordered when load() returns."""
        plans = plan(self.space, jobs, self.page_size, self.num_pages, loading=True)
        if waves < 1:
            raise ValueError(f"a load needs at least one wave, got {waves}")
        if waves == 1:
            return self._load(plans, checksums)
        return self._load_waves(plans, checksums, plan_waves(plans, self.layout.num_layers, waves,
                                                             self._wave_item_pages()))

    def close(self) -> None:
        """Give the arena back: unregister every DMA piece of it this process registered (CUDA; nothing on a CPU), so
        the mapping can be unmapped. Call only when no copy through this transfer is in flight, and before the
        mapping goes (kvshare.connector.arena_life says why); the transfer is not used afterwards."""
        unregister_pages(self.pages)

    def checksum(self, pages: Sequence[int], nbytes: int) -> int:
        """The checksum of a chunk as it lies in the arena now (kvshare.checksum); only after its store is done."""
        return arena_checksum(self._arena, pages, nbytes)

    def start_checksums(self, chunks: Iterable[tuple[Sequence[int], int]],
                        before: Callable[[], None] = lambda: None) -> list[Future]:
        """The checksums of many chunks, hashed in parallel on host threads after `before()`; futures in input order.
        The caller keeps the pages unchanged until every future is done (a read lease, or a finished store)."""
        return start_checksums(self._arena, chunks, before)

    def _extents(self, plans: list[ChunkPlan]) -> list[tuple[list[int], int]]:
        """(page ids, nbytes) of each planned chunk."""
        return [(chunk.pages.tolist(), chunk.nbytes(self.page_size, self.layout.block_bytes)) for chunk in plans]

    def _zero_tails(self, plans: list[ChunkPlan]) -> None:
        used = self.units_per_page * self.layout.block_bytes
        if used == self.page_size:
            return
        for chunk in plans:  # every page but the last (the extent ends at the last page's last unit)
            self._arena[chunk.pages[:-1], used:] = 0

    def _store(self, plans: list[ChunkPlan]) -> TransferHandle:
        raise NotImplementedError

    def _load(self, plans: list[ChunkPlan], checksums: bool) -> TransferHandle:
        raise NotImplementedError

    def _load_waves(self, plans: list[ChunkPlan], checksums: bool, waves: WavePlan) -> TransferHandle:
        raise NotImplementedError

    def _wave_item_pages(self) -> int | None:
        """Most pages one item of a layered load may carry (None: a wave's pages of a chunk in one item)."""
        return None


def make_transfer(
    layout: KVLayout,
    kv_caches: Sequence[torch.Tensor],
    pages: torch.Tensor,
    *,
    options: TransferOptions | None = None,
) -> Transfer:
    """The transfer path for the device the KV tensors live on. Raises LayoutMismatch/ValueError on bad input."""
    options = options or TransferOptions()
    space = build_block_space(layout, kv_caches)
    if space.device.type == "cpu":
        from kvshare.transfer.cpu import CpuTransfer

        return CpuTransfer(space, pages, options)
    if space.device.type == "cuda":
        from kvshare.transfer.cuda import CudaTransfer

        return CudaTransfer(space, pages, options)
    raise ValueError(f"KV tensors on {space.device}: only cpu and cuda are supported")


def arena_pages(client: PoolClient) -> torch.Tensor:
    """uint8 [num_pages, page_size] torch tensor sharing memory with the client's arena mapping (zero copy): what
    make_transfer takes as `pages`."""
    return torch.from_numpy(client.pages)
