"""Decode as CUDA graphs (kvshare.engine.cuda_graphs): which batch sizes are captured (CPU), and on CUDA that a
replica decoding through its graphs answers exactly as one decoding eagerly, alone and in a padded batch, with the
scratch block kept from the block manager."""

import pytest
import torch

from kvshare.engine.api import GenerationRequest, SamplingParams
from kvshare.engine.config import EngineConfig
from kvshare.engine.cuda_graphs import capture_sizes
from kvshare.engine.engine import Engine, generate


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    for n in range(1, 70):  # every batch size has a captured size that holds it
        sizes = capture_sizes(n)
        assert all(any(s >= b for s in sizes) for b in range(1, n + 1)) and max(sizes) == n


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_decode_answers_as_eager_decode(tiny_model):
    def engine(eager):
        # float32: a batch of 3 runs 3-row products eagerly and 4-row ones in the graph; in bf16 their rounding could
        # flip a near-tie of the random model, in fp32 it stays far below any logit gap
        return Engine(EngineConfig(model=str(tiny_model), device="cuda", dtype="float32", num_blocks=256,
                                   max_model_len=2048, max_num_seqs=4, enforce_eager=eager))

    prompts = [torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (37, 300, 5)]
    answers = {}
    for eager in (True, False):
        e = engine(eager)
        try:
            assert (e.runner.graphs is None) == eager
            if not eager:  # the last block is the padding rows' scratch: never handed out
                assert e.block_manager.num_blocks == e.runner.num_blocks - 1
            alone = generate(e, [GenerationRequest("a", tuple(prompts[0]), SamplingParams(max_tokens=12))])
            batch = generate(e, [GenerationRequest(f"b{i}", tuple(p), SamplingParams(max_tokens=12, ignore_eos=True))
                                 for i, p in enumerate(prompts)])  # 3 sequences: the size-4 graph, one padding row
            answers[eager] = [r.token_ids for r in alone + batch]
        finally:
            e.shutdown()
    assert answers[False] == answers[True]
