"""The unit kernel moves each unit to or from its own block for layers allocated one by one, the block's packed
bytes (K then V, tests.transfer.conftest) being the reference: every kind (one run a block, or K and V as two),
slots that start mid-layer, skip markers and every other block left untouched, both directions. A space whose layers
share one storage gets no table (the torch form is one op there already). On a GPU directly; without one under
Triton's interpreter (tests/engine/test_paged_interpreter.py runs this file)."""

import numpy as np
import pytest
import torch

from kvshare.transfer import KINDS, KVLayout
from kvshare.transfer.blocks import build_block_space
from kvshare.transfer.unit_kernel import LayerTable, available
from tests.transfer.conftest import block_bytes_of, make_kv

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not available(DEVICE), reason="needs CUDA + Triton, or Triton's interpreter")
BLOCKS_PER_CHUNK = 4


def _space(kind, fused=False, heads=2):
    layout = KVLayout(3, 16, 16, heads, 64, torch.bfloat16, kind=kind)
    layers = make_kv(layout, device=DEVICE, fused=fused, seed=7)
    return layout, layers, build_block_space(layout, layers)


def _rows(space, block_ids):
    """A chunk's unit rows (layer-major), as the planner makes them: -1 for a skipped block."""
    return space.rows(np.asarray(block_ids, dtype=np.int64))


def _blocks(layout, layers):
    """{(layer, block): its packed bytes} for every block of every layer."""
    return {(l, b): block_bytes_of(layout, layers[l], b) for l in range(layout.num_layers)
            for b in range(layout.num_blocks)}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("u_start, u_end", [(0, 12), (3, 10), (5, 6)])  # whole chunk; mid-layer slots
def test_scatter_writes_each_unit_to_its_block_and_nothing_else(kind, u_start, u_end):
    layout, layers, space = _space(kind)
    table = LayerTable.of(space)
    assert table is not None
    rows = _rows(space, [9, -1, 2, 14])  # block 1 of the chunk skipped
    rng = np.random.default_rng(u_start * 31 + u_end)
    units = torch.from_numpy(rng.integers(0, 256, (u_end - u_start, layout.block_bytes), dtype=np.uint8)).to(DEVICE)
    before = _blocks(layout, layers)
    table.move(units, torch.from_numpy(rows).to(DEVICE), 0, u_start, u_end, BLOCKS_PER_CHUNK, True)
    after = _blocks(layout, layers)
    written = set()
    for u in range(u_start, u_end):  # one group a layer: a unit's row is its block id
        if rows[u] >= 0:
            written.add(key := (u // BLOCKS_PER_CHUNK, int(rows[u])))
            assert np.array_equal(after[key], units[u - u_start].cpu().numpy())  # it holds its staged unit
    # every other block, the skipped one's included, keeps its bytes
    assert all(np.array_equal(after[key], before[key]) for key in after if key not in written)


@pytest.mark.parametrize("kind", list(KINDS))
def test_gather_reads_each_unit_from_its_block(kind):
    layout, layers, space = _space(kind, heads=3)  # 3 heads: runs that are not a power of two
    table = LayerTable.of(space)
    rows = _rows(space, [11, 0, 5, 6])
    index = torch.from_numpy(rows).to(DEVICE)
    got = torch.zeros(12, layout.block_bytes, dtype=torch.uint8, device=DEVICE)
    table.move(got, index, 0, 0, 12, BLOCKS_PER_CHUNK, False)
    for u in range(12):  # unit u is block rows[u] of layer u // BLOCKS_PER_CHUNK, packed (K then V)
        assert np.array_equal(got[u].cpu().numpy(), block_bytes_of(layout, layers[u // BLOCKS_PER_CHUNK], rows[u]))


def test_a_row_offset_reads_the_item_s_rows():
    layout, layers, space = _space("vllm_lbnhc")
    table = LayerTable.of(space)
    rows = np.concatenate([_rows(space, [1, 2, 3, 4]), _rows(space, [8, 9, 10, 11])])  # two chunks' rows
    index = torch.from_numpy(rows).to(DEVICE)
    got = torch.zeros(12, layout.block_bytes, dtype=torch.uint8, device=DEVICE)
    table.move(got, index, 12, 0, 12, BLOCKS_PER_CHUNK, False)  # the second chunk
    assert np.array_equal(got[11].cpu().numpy(), block_bytes_of(layout, layers[2], 11))


def test_warm_moves_nothing():
    layout, layers, space = _space("split_kv")
    units = torch.from_numpy(np.random.default_rng(3).integers(0, 256, (12, layout.block_bytes), dtype=np.uint8))
    units = units.to(DEVICE)
    staged, before = units.clone(), _blocks(layout, layers)
    LayerTable.of(space).warm(units)
    after = _blocks(layout, layers)
    assert torch.equal(units, staged) and all(np.array_equal(after[key], before[key]) for key in after)


def test_one_storage_gets_no_table():
    _, _, space = _space("packed_kv", fused=True)
    assert len(space.groups) == 1 and LayerTable.of(space) is None


def _compiled_variants() -> int:
    from kvshare.transfer.unit_kernel import _move_units

    return sum(len(caches[0]) for caches in _move_units.device_caches.values())  # (kernel cache, ...) per device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled variants exist on a GPU only")
def test_after_warm_no_item_compiles_another_variant():
    layout, layers, space = _space("vllm_lbnhc")
    table = LayerTable.of(space)
    units = torch.zeros(12, layout.block_bytes, dtype=torch.uint8, device=DEVICE)
    table.warm(units)
    compiled = _compiled_variants()
    rows = torch.from_numpy(np.concatenate([_rows(space, [1, 2, 3, 4])] * 3)).to(DEVICE)
    for row_offset, u_start, u_end, to_blocks in [(0, 0, 12, True), (12, 3, 10, False), (17, 1, 7, True)]:
        table.move(units, rows, row_offset, u_start, u_end, BLOCKS_PER_CHUNK, to_blocks)
    torch.cuda.synchronize()
    assert _compiled_variants() == compiled  # row offsets and slot starts of any value run the warmed code
