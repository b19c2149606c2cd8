"""The CUDA path: gathers/scatters on a side stream, DMA between a device staging ring and the registered arena.

Two side streams per Transfer: `gather` (index_select / index_copy_ kernels, or one unit-kernel launch a slot where
the layers are separate allocations: kvshare.transfer.unit_kernel) and `copy` (host<->device DMA), so the gather of
one slot overlaps the copy of another. Every cross-stream dependency is an event, each one commented:
- I4 store: `gather` waits on an event recorded on the caller's (producing) stream at store() time, so it reads KV
  only after every kernel already queued there, including the one that wrote that KV. The caller keeps the source
  blocks untouched until the returned TransferHandle is done (its event is recorded after the last copy).
- I5 load: the caller's (consuming) stream waits on the event recorded after the last scatter, before load()
  returns, so any kernel queued afterwards reads the loaded blocks, never poison or partial data.
- Load also waits, before scattering, for the work already queued on the caller's stream (it may still read the
  destination blocks for the request that owned them before): a write-after-read hazard.
- Checksums (checksums="device"): a third stream, `hash` (DeviceHasher), hashes each slot after the event that
  filled it (store: the gather's; load: the copy's), beside the DMA of that slot and the gather/copy of the next, so
  only the last slot's hash outlasts the copies. Its results reach the host by one small copy and their own event.
- Staging slot reuse: a slot's next writer waits on the events recorded after its last readers (the copy or scatter,
  and the hash), because the host enqueues far ahead of the GPU and would otherwise overwrite a slot still in use.
- Memory: index tensors are allocated while the stream that uses them is current, and the staging ring is marked
  with record_stream for every side stream, so the caching allocator never hands out memory still in use.
ordering="none" (validation only) drops the caller-stream waits in both directions; nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from kvshare.transfer.blocks import BlockSpace
from kvshare.transfer.checksum import DeviceHasher, results_of
from kvshare.transfer.cpu import kept_segments
from kvshare.transfer.hostmem import Pieces, registration
from kvshare.transfer.jobs import ChunkPlan, TransferHandle
from kvshare.transfer.transfer import Transfer, TransferOptions
from kvshare.transfer.unit_kernel import LayerTable
from kvshare.transfer.waves import WavePlan

HIGHEST_PRIORITY = -(1 << 10)  # below any device's range: torch clamps it to the highest priority there is


@dataclass
class _Slot:
    buffer: torch.Tensor  # uint8 [slot_pages, units_per_page * block_bytes]: page-shaped staging
    free: list[torch.cuda.Event] = field(default_factory=list)  # after the slot's last readers; its next writer waits


@dataclass(frozen=True)
class SlotItem:
    """Pages [j0, j1) of one chunk: what one staging slot carries."""

    chunk: ChunkPlan
    row_offset: int  # where the chunk's rows start in the batch's device index tensor
    j0: int
    j1: int
    wave: int = 0  # a layered load's wave (kvshare.transfer.waves)


class CudaTransfer(Transfer):
    def __init__(self, space: BlockSpace, pages: torch.Tensor, options: TransferOptions):
        super().__init__(space, pages, options)
        self.device = space.device
        # torch maps a priority below the device's range onto its highest one; 0 is the default priority
        priority = HIGHEST_PRIORITY if options.stream_priority == "high" else 0
        self.gather_stream = torch.cuda.Stream(self.device, priority=priority)
        self.copy_stream = torch.cuda.Stream(self.device, priority=priority)
        self.used_per_page = self.units_per_page * self.layout.block_bytes
        self.slot_pages = max(1, options.staging_bytes // self.page_size)
        on_device = options.checksums == "device" and DeviceHasher.supports(
            self.page_size, self.used_per_page, self.layout.block_bytes)
        self.hasher = DeviceHasher(self.device, self.page_size, self.used_per_page, priority) if on_device else None
        self._slots = [self._new_slot() for _ in range(options.staging_slots)]
        self._next_slot = 0
        # One launch a slot for a space of many groups (vLLM's tensor per layer): kvshare.transfer.unit_kernel.
        # Compiled here, before the registration below starts (loading a kernel is a driver call too).
        self.layer_table = LayerTable.of(space) if options.unit_kernel else None
        if self.layer_table is not None:
            self.layer_table.warm(self._slots[0].buffer.view(-1, self.layout.block_bytes))
        # Once per process and arena view (hostmem keeps the registry); in the background unless register_ahead is off.
        # Started last: streams and device allocations above are driver calls, and a cudaHostRegister under way on a
        # background thread may hold the driver's lock for seconds a piece (H200 run 12: attach waited for every
        # piece), so this constructor makes them before the first piece starts.
        self.registration = registration(pages, options.register_piece_bytes, options.register_threads,
                                         ahead=options.register_ahead)
        self.pieces = self.registration.pieces

    def _new_slot(self) -> _Slot:
        buffer = torch.empty(self.slot_pages, self.used_per_page, dtype=torch.uint8, device=self.device)
        # Allocated on the current stream but used on the side streams: tell the allocator, so freeing the
        # Transfer cannot recycle a buffer whose copies or hashes are still queued.
        for stream in self._side_streams():
            buffer.record_stream(stream)
        return _Slot(buffer)

    def _side_streams(self) -> list[torch.cuda.Stream]:
        return [self.gather_stream, self.copy_stream] + ([self.hasher.stream] if self.hasher else [])

    def _acquire(self, stream: torch.cuda.Stream) -> _Slot:
        slot = self._slots[self._next_slot]
        self._next_slot = (self._next_slot + 1) % len(self._slots)
        for event in slot.free:
            stream.wait_event(event)  # WAR on staging: the slot's previous readers must have finished
        return slot

    @staticmethod
    def _release(slot: _Slot, *readers: torch.cuda.Stream) -> None:
        """Record, on each stream that reads the slot, an event after its last read (the next writer waits on all)."""
        slot.free = []
        for stream in readers:
            event = torch.cuda.Event()
            event.record(stream)
            slot.free.append(event)

    # ---- store -------------------------------------------------------------------------------------------------
    def _store(self, plans: list[ChunkPlan]) -> TransferHandle:
        caller = torch.cuda.current_stream(self.device)
        produced = torch.cuda.Event()
        produced.record(caller)
        if self.options.ordering == "stream":
            self.gather_stream.wait_event(produced)  # I4: read KV only after the kernels that wrote it
        self._ensure_registered(plans)
        rows, items = self._prepare(plans)
        parts = []
        for item in items:
            slot = self._acquire(self.gather_stream)
            with torch.cuda.stream(self.gather_stream):
                self._gather(item, rows, slot)
            gathered = torch.cuda.Event()
            gathered.record(self.gather_stream)
            self.copy_stream.wait_event(gathered)  # RAW on staging: copy out only what the gather wrote
            with torch.cuda.stream(self.copy_stream):
                self._copy_pages(item, slot, to_host=True)
            if self.hasher:  # the same bytes the copy writes to the arena, hashed beside it
                parts.append(self._hash(item, slot, gathered))
            self._release(slot, *self._readers(self.copy_stream))
        done = self._finish(self.copy_stream)  # I4: the source blocks are free once this fires
        if self.hasher:
            return _EventHandle(done, self._device_checksums(plans, items, parts))
        # Host hashing reads the arena, so it waits for the copies that write it.
        return _EventHandle(done, results_of(self.start_checksums(self._extents(plans), before=done.synchronize)))

    def _gather(self, item: SlotItem, rows: torch.Tensor, slot: _Slot) -> None:
        units = slot.buffer.view(-1, self.layout.block_bytes)  # [slot_pages * upp, block_bytes]
        u_start, u_end = item.chunk.page_units(item.j0)[0], item.chunk.page_units(item.j1 - 1)[1]
        if self.layer_table is not None:
            self.layer_table.move(units, rows, item.row_offset, u_start, u_end, item.chunk.blocks_per_chunk, False)
            return
        for group, a, b in self.space.group_spans(item.chunk.blocks_per_chunk, u_start, u_end):
            index = rows[item.row_offset + a : item.row_offset + b]
            for view, offset in zip(group.views, self.space.run_offsets):
                out = units[a - u_start : b - u_start, offset : offset + self.space.run_bytes]
                torch.index_select(view, 0, index, out=out)

    # ---- load --------------------------------------------------------------------------------------------------
    def _load(self, plans: list[ChunkPlan], checksums: bool) -> TransferHandle:
        return self._load_items(plans, checksums, None)

    def _load_waves(self, plans: list[ChunkPlan], checksums: bool, waves: WavePlan) -> TransferHandle:
        return self._load_items(plans, checksums, waves)

    def _wave_item_pages(self) -> int:
        return self.slot_pages

    def _load_items(self, plans: list[ChunkPlan], checksums: bool, waves: WavePlan | None) -> TransferHandle:
        caller = torch.cuda.current_stream(self.device)
        earlier = torch.cuda.Event()
        earlier.record(caller)
        if self.options.ordering == "stream":
            self.gather_stream.wait_event(earlier)  # WAR: earlier kernels may still read the destination blocks
        self._ensure_registered(plans)
        rows, items = self._prepare(plans, waves)
        on_host = checksums and not self.hasher
        # Host hashing reads the arena, which the read lease keeps unchanged: it starts at once, beside the copies.
        host_sums = self.start_checksums(self._extents(plans)) if on_host else []
        parts, landed = [], [None] * (len(waves.waves) if waves else 1)
        for k, item in enumerate(items):
            if self.options.side_delay_cycles and (k == 0 or items[k - 1].wave != item.wave):
                with torch.cuda.stream(self.copy_stream):
                    torch.cuda._sleep(self.options.side_delay_cycles)  # validation only: make the load (wave) late
            slot = self._acquire(self.copy_stream)
            with torch.cuda.stream(self.copy_stream):
                self._copy_pages(item, slot, to_host=False)
            copied = torch.cuda.Event()
            copied.record(self.copy_stream)
            self.gather_stream.wait_event(copied)  # RAW on staging: scatter only after the pages arrived
            with torch.cuda.stream(self.gather_stream):
                self._scatter(item, rows, slot)
            if checksums and self.hasher:  # the bytes just read from the arena, hashed beside the scatter
                parts.append(self._hash(item, slot, copied))
            self._release(slot, *self._readers(self.gather_stream, hashed=checksums))
            if waves and (k + 1 == len(items) or items[k + 1].wave != item.wave):
                # After the wave's last scatter, and so after every earlier wave's (one stream, in order).
                landed[item.wave] = self._finish(self.gather_stream)
        sums = None
        if checksums:
            sums = self._device_checksums(plans, items, parts) if self.hasher else results_of(host_sums)
        done = self._finish(self.gather_stream)
        if waves:
            return _EventHandle(done, sums, self._layer_ready(landed, waves))
        if self.options.ordering == "stream":
            caller.wait_event(done)  # I5: later kernels on the caller's stream see the loaded blocks
        return _EventHandle(done, sums)

    def _layer_ready(self, landed: list[torch.cuda.Event | None], waves: WavePlan) -> Callable[[int], None]:
        """I5 per layer for a load in waves: the stream current at the call (the one the layer's attention is
        queued on) waits on the event of the layer's wave. Every event was recorded before load() returned: a
        wait_event on an event not yet recorded would wait for nothing."""

        def layer_ready(layer: int) -> None:
            wave = int(waves.ready[layer])
            event = landed[wave] if wave >= 0 else None
            if event is not None and self.options.ordering == "stream":
                torch.cuda.current_stream(self.device).wait_event(event)

        return layer_ready

    def _scatter(self, item: SlotItem, rows: torch.Tensor, slot: _Slot) -> None:
        units = slot.buffer.view(-1, self.layout.block_bytes)
        chunk = item.chunk
        u_start, u_end = chunk.page_units(item.j0)[0], chunk.page_units(item.j1 - 1)[1]
        if self.layer_table is not None:  # skip markers (rows < 0) are left alone by the kernel
            self.layer_table.move(units, rows, item.row_offset, u_start, u_end, chunk.blocks_per_chunk, True)
            return
        for group, a, b in self.space.group_spans(chunk.blocks_per_chunk, u_start, u_end):
            for s, e in kept_segments(chunk.rows, a, b):
                index = rows[item.row_offset + s : item.row_offset + e]
                for view, offset in zip(group.views, self.space.run_offsets):
                    view.index_copy_(0, index, units[s - u_start : e - u_start, offset : offset + self.space.run_bytes])

    # ---- shared ------------------------------------------------------------------------------------------------
    def _ensure_registered(self, plans: list[ChunkPlan]) -> None:
        """Block until the pieces of the arena holding the batch's pages are registered (before any copy is queued:
        a DMA from an unregistered page would be a slow pageable copy, or fail)."""
        if plans:
            self.registration.ensure(np.concatenate([chunk.pages for chunk in plans]))

    def _prepare(self, plans: list[ChunkPlan],
                 waves: WavePlan | None = None) -> tuple[torch.Tensor, list[SlotItem]]:
        """Upload the batch's unit rows and cut it into slot-sized items: chunk by chunk, or wave by wave."""
        offsets = np.cumsum([0] + [len(chunk.rows) for chunk in plans])
        if waves is None:
            items = [SlotItem(chunk, int(offsets[c]), j0, min(j0 + self.slot_pages, len(chunk.pages)))
                     for c, chunk in enumerate(plans) for j0 in range(0, len(chunk.pages), self.slot_pages)]
        else:  # plan_waves cut them to slot_pages (_wave_item_pages)
            items = [SlotItem(plans[i.chunk], int(offsets[i.chunk]), i.j0, i.j1, i.wave) for i in waves.items]
        host_rows = np.concatenate([chunk.rows for chunk in plans]) if plans else np.zeros(0, np.int64)
        # Allocated while gather_stream is current, the only stream that reads it: its memory is then recycled
        # only after that stream's queued gathers/scatters (the allocator orders reuse per stream). The upload is
        # from pinned memory and non-blocking: a blocking copy would synchronize gather_stream, i.e. make the host
        # wait for the producer's kernels (store) or for earlier batches; the pinned buffer is kept by the caching
        # host allocator until the copy has run.
        with torch.cuda.stream(self.gather_stream):
            rows = torch.from_numpy(host_rows).pin_memory().to(self.device, non_blocking=True)
        return rows, items

    def _copy_pages(self, item: SlotItem, slot: _Slot, to_host: bool) -> None:
        """Non-blocking DMA between the slot and the item's arena pages, coalescing runs of adjacent full pages."""
        staging, arena = slot.buffer.view(-1), self.pages.view(-1)
        for k0, page, nbytes in page_runs(item, self.used_per_page, self.layout.block_bytes, self.pieces):
            device_part = staging[k0 * self.used_per_page : k0 * self.used_per_page + nbytes]
            host_part = arena[page * self.page_size : page * self.page_size + nbytes]
            if to_host:
                host_part.copy_(device_part, non_blocking=True)
            else:
                device_part.copy_(host_part, non_blocking=True)

    def _hash(self, item: SlotItem, slot: _Slot, filled: torch.cuda.Event) -> torch.Tensor:
        nbytes = item.chunk.nbytes(self.page_size, self.layout.block_bytes)
        return self.hasher.add(slot.buffer, nbytes, item.j0, item.j1, filled)

    def _readers(self, stream: torch.cuda.Stream, hashed: bool = True) -> list[torch.cuda.Stream]:
        """The streams that read a slot: the copy (store) or scatter (load), and the hash stream when it hashed."""
        return [stream] + ([self.hasher.stream] if self.hasher and hashed else [])

    def _device_checksums(self, plans: list[ChunkPlan], items: list[SlotItem], parts: list[torch.Tensor]):
        owner = {id(chunk): c for c, chunk in enumerate(plans)}
        extents = [nbytes for _, nbytes in self._extents(plans)]
        return self.hasher.finish(parts, [owner[id(item.chunk)] for item in items], extents)

    @staticmethod
    def _finish(last: torch.cuda.Stream) -> torch.cuda.Event:
        done = torch.cuda.Event()
        done.record(last)  # after the batch's last operation (every earlier one precedes it via the events above)
        return done


class _EventHandle(TransferHandle):
    def __init__(self, event: torch.cuda.Event, checksums: Callable[[], list[int]] | None,
                 layer_ready: Callable[[int], None] = lambda layer: None):
        super().__init__(event.query, event.synchronize, checksums, layer_ready)
        self.event = event


def page_runs(item: SlotItem, used_per_page: int, block_bytes: int, pieces: Pieces) -> list[tuple[int, int, int]]:
    """(slot page index, first arena page, bytes) per copy: adjacent pages merge while each is used in full, and a
    run never crosses from one registration piece into the next (each piece is its own pinned allocation)."""
    page_size = pieces.page_size
    runs: list[list[int]] = []
    for j in range(item.j0, item.j1):
        u0, u1 = item.chunk.page_units(j)
        nbytes, page = (u1 - u0) * block_bytes, int(item.chunk.pages[j])
        last = runs[-1] if runs else None
        if (last and used_per_page == page_size and last[1] + last[2] // page_size == page
                and last[2] % page_size == 0 and page % pieces.pages_per_piece != 0):
            last[2] += nbytes
        else:
            runs.append([j - item.j0, page, nbytes])
    return [tuple(run) for run in runs]
