"""Planning a batch: the batch-at-once path (uniform valid jobs) gives exactly the job-by-job plans, and leaves every
other batch, valid or not, to the job-by-job path and its messages."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare.transfer import SKIP, KVLayout, LoadJob, StoreJob
from kvshare.transfer.blocks import build_block_space
from kvshare.transfer.jobs import _plan_each, _plan_uniform, plan
from tests.transfer.conftest import make_kv

LAYOUT = KVLayout(num_layers=3, num_blocks=12, block_size=2, num_kv_heads=1, head_size=4, dtype=torch.float32)
PAGE_SIZE = LAYOUT.block_bytes * 2 + 8  # two units a page, and a tail
NUM_PAGES = 40


@st.composite
def batches(draw):
    loading = draw(st.booleans())
    blocks = draw(st.integers(1, 3))
    need = LAYOUT.pages_needed(blocks * LAYOUT.block_size, PAGE_SIZE)
    jobs = []
    for _ in range(draw(st.integers(1, 4))):
        n_ids = blocks if draw(st.integers(0, 9)) else draw(st.integers(0, 4))  # mostly uniform
        n_pages = need if draw(st.integers(0, 9)) else draw(st.integers(0, need + 1))
        ids = draw(st.lists(st.integers(SKIP - 1 if loading else -1, LAYOUT.num_blocks), min_size=n_ids,
                            max_size=n_ids))
        pages = draw(st.lists(st.integers(-1, NUM_PAGES), min_size=n_pages, max_size=n_pages))
        jobs.append(LoadJob(pages=pages, block_ids=ids) if loading else StoreJob(block_ids=ids, pages=pages))
    return loading, jobs, draw(st.booleans())


@settings(max_examples=300, deadline=None)
@given(batches())
def test_batch_at_once_plans_equal_job_by_job_plans(batch):
    loading, jobs, fused = batch
    space = build_block_space(LAYOUT, make_kv(LAYOUT, fused=fused))
    try:
        expected = _plan_each(space, jobs, PAGE_SIZE, NUM_PAGES, loading)
    except ValueError:
        assert _plan_uniform(space, jobs, PAGE_SIZE, NUM_PAGES, loading) is None  # the bad batch is left to it
        return
    got = _plan_uniform(space, jobs, PAGE_SIZE, NUM_PAGES, loading)
    if len({len(job.block_ids) for job in jobs}) > 1:  # ragged: left to the job-by-job path
        assert got is None
        return
    assert got is not None and len(got) == len(expected)
    for a, b in zip(got, expected):
        assert np.array_equal(a.rows, b.rows) and a.rows.dtype == b.rows.dtype == np.int64
        assert np.array_equal(a.pages, b.pages)
        assert (a.blocks_per_chunk, a.units_per_page) == (b.blocks_per_chunk, b.units_per_page)


def test_a_uniform_batch_is_planned_at_once_and_a_bad_one_named_job_by_job():
    space = build_block_space(LAYOUT, make_kv(LAYOUT))
    need = LAYOUT.pages_needed(2 * LAYOUT.block_size, PAGE_SIZE)
    jobs = [LoadJob(pages=list(range(c * need, (c + 1) * need)), block_ids=[2 * c, SKIP]) for c in range(3)]
    assert _plan_uniform(space, jobs, PAGE_SIZE, NUM_PAGES, True) is not None
    bad = jobs[:2] + [LoadJob(pages=jobs[2].pages, block_ids=[0, 1])]  # block 0 loaded twice
    with pytest.raises(ValueError, match="load job 2: a block is written twice"):
        plan(space, bad, PAGE_SIZE, NUM_PAGES, loading=True)
