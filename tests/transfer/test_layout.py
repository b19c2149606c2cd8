"""KVLayout: reading tensors of every kind, refusing mismatches, sizes, and the layout id."""

import pytest
import torch

from kvshare.transfer import KINDS, KVLayout, LayoutMismatch
from tests.transfer.conftest import make_kv


def _layout(kind="packed_kv", **kw):
    base = dict(num_layers=3, num_blocks=10, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    return KVLayout(**{**base, **kw}, kind=kind)


@pytest.mark.parametrize("kind", list(KINDS))
def test_from_tensors_reads_every_kind(kind):
    layout = _layout(kind)
    assert KVLayout.from_tensors(make_kv(layout), kind=kind, block_size=4) == layout


def test_mismatches_are_named():
    layout = _layout()
    layers = make_kv(layout)
    with pytest.raises(LayoutMismatch, match="dtype"):
        _layout(dtype=torch.float16).check_tensors(layers)
    with pytest.raises(LayoutMismatch, match="shape"):
        _layout(num_blocks=11).check_tensors(layers)
    with pytest.raises(LayoutMismatch, match="layers"):
        _layout(num_layers=4).check_tensors(layers)
    with pytest.raises(LayoutMismatch, match="block size 4, expected 16"):
        KVLayout.from_tensors(layers, block_size=16)
    with pytest.raises(LayoutMismatch, match="strides"):  # NHD strides are not HND
        KVLayout.from_tensors(make_kv(_layout("vllm_lbnhc", num_kv_heads=4)), kind="vllm_lbhnc")
    with pytest.raises(LayoutMismatch, match="dims"):
        KVLayout.from_tensors(layers, kind="vllm_lbhnc")
    with pytest.raises(ValueError, match="unknown KV layout kind"):
        KVLayout.from_tensors(layers, kind="nope")


def test_sizes_and_packing_helpers():
    layout = _layout()  # block_bytes = 2 * 4 * 2 * 8 * 2 = 256
    assert layout.block_bytes == 256
    assert layout.chunk_bytes(8) == 3 * 2 * 256
    assert layout.units_per_page(1000) == 3
    assert layout.pages_needed(8, 1000) == 2  # 6 units, 3 a page
    assert layout.chunk_nbytes(8, 1000) == 1000 + 3 * 256
    with pytest.raises(ValueError, match="not a positive multiple of the block size 4"):
        layout.chunk_bytes(6)
    with pytest.raises(ValueError, match="page size of at least 256"):
        layout.units_per_page(100)


def test_layout_id_is_stable_and_tracks_the_bytes():
    layout = _layout()
    assert layout.layout_id() == _layout().layout_id() == _layout(num_blocks=99).layout_id()
    for change in (dict(kind="split_kv"), dict(dtype=torch.float16), dict(block_size=8), dict(head_size=16),
                   dict(num_kv_heads=4), dict(num_layers=2)):
        assert _layout(**change).layout_id() != layout.layout_id(), change
    assert layout.layout_id() == "0a154606f9d78c8b7be35ef30f15419b"  # fixed across processes and releases
