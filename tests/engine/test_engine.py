"""The engine end to end on the tiny model (fp32 CPU): paged/chunked == full forward, prefix cache, sampling, stops,
concurrency, preemption, bad requests, abort."""

import threading
import time

import torch

from kvshare.engine.api import GenerationRequest, SamplingParams
from kvshare.engine.engine import generate
from kvshare.engine.model import Rotary

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def prompt(n, offset=0):
    return tuple((7 * i + offset) % 1000 + 3 for i in range(n))


def run(engine, prompt_ids, sampling=GREEDY, rid="r"):
    (result,) = generate(engine, [GenerationRequest(rid, tuple(prompt_ids), sampling)], timeout=120)
    return result


def reference_greedy(model, prompt_ids, n):
    """Greedy tokens recomputing the whole sequence in one unchunked prefill per token (no cache reuse at all)."""
    c = model.config
    rotary = Rotary(c, torch.device("cpu"), torch.float32)
    tokens = list(prompt_ids)
    for _ in range(n):
        caches = [torch.zeros(64, 2, 16, c.num_kv_heads, c.head_dim) for _ in range(c.num_layers)]
        logits = model.prefill(torch.tensor(tokens), 0, caches, torch.arange(64), rotary, chunk=4096)
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt_ids):]


def test_chunked_paged_decode_matches_full_forward(make_engine):
    engine = make_engine(block_size=4, prefill_chunk=5)
    p = prompt(45)
    result = run(engine, p)
    assert result.token_ids == reference_greedy(engine.runner.model, p, 12)
    assert result.finished.finish_reason == "length" and result.finished.usage.completion_tokens == 12


def test_prefix_cache_hits_give_identical_tokens(make_engine):
    engine, cold = make_engine(), make_engine()
    p = prompt(70)
    first = run(engine, p, rid="a")
    assert first.finished.usage.local_hit_tokens == 0
    again = run(engine, p, rid="b")
    assert again.token_ids == first.token_ids
    assert again.finished.usage.local_hit_tokens == 64 and again.finished.usage.cached_tokens == 64
    # Next turn: prompt + answer + new text hits the blocks completed by generated tokens too.
    turn2 = p + tuple(first.token_ids) + prompt(9, 5)
    hit = run(engine, turn2, rid="c")
    assert hit.finished.usage.local_hit_tokens == (len(p) + len(first.token_ids) - 1) // 16 * 16
    assert hit.token_ids == run(cold, turn2, rid="cold").token_ids
    engine.block_manager.check_integrity()


def test_seeded_sampling_is_reproducible(make_engine):
    engine = make_engine()
    sp = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=123, ignore_eos=True)
    solo = run(engine, prompt(20), sp).token_ids
    batch = generate(engine, [GenerationRequest("x", prompt(20), sp), GenerationRequest("y", prompt(30, 1), sp),
                              GenerationRequest("z", prompt(20), SamplingParams(10, 0.9, 0.9, 7, ignore_eos=True))])
    assert batch[0].token_ids == solo
    assert batch[2].token_ids != solo


def test_stop_tokens_eos_and_max_tokens(make_engine):
    engine = make_engine()
    tokens = run(engine, prompt(20)).token_ids
    stop_at = tokens[3]
    first_stop = tokens.index(stop_at)
    stopped = run(engine, prompt(20), SamplingParams(max_tokens=12, stop_token_ids=(stop_at,), ignore_eos=True))
    assert stopped.token_ids == tokens[:first_stop]  # the stop token itself is not emitted
    assert stopped.finished.finish_reason == "stop" and stopped.finished.usage.completion_tokens == first_stop + 1
    engine.eos_token_ids = (stop_at,)
    assert run(engine, prompt(20), SamplingParams(max_tokens=12)).token_ids == tokens[:first_stop]
    assert run(engine, prompt(20), SamplingParams(max_tokens=12, ignore_eos=True)).token_ids == tokens
    assert len(run(engine, prompt(20), SamplingParams(max_tokens=1, ignore_eos=True)).token_ids) == 1


def test_concurrent_submits_all_complete_with_solo_outputs(make_engine):
    engine = make_engine()
    prompts = [prompt(10 + 9 * i, i) for i in range(8)]
    solo = [run(engine, p, rid=f"solo{i}").token_ids for i, p in enumerate(prompts)]
    results = {}
    done = threading.Barrier(len(prompts) + 1, timeout=120)

    def client(i):
        results[i] = generate(engine, [GenerationRequest(f"c{i}", prompts[i], GREEDY)], timeout=120)[0]
        done.wait()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    done.wait()
    assert [results[i].token_ids for i in range(len(prompts))] == solo


def test_preemption_when_blocks_run_out(make_engine):
    big, small = make_engine(), make_engine(num_blocks=12)  # 12 blocks of 16 tokens; each request needs 5
    prompts = [prompt(40, i) for i in range(4)]
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    expected = [r.token_ids for r in generate(big, [GenerationRequest(f"e{i}", p, sp) for i, p in enumerate(prompts)])]
    got = generate(small, [GenerationRequest(f"g{i}", p, sp) for i, p in enumerate(prompts)], timeout=120)
    assert [r.token_ids for r in got] == expected
    small.block_manager.check_integrity()
    assert small.block_manager.num_free == 12


def test_bad_requests_get_errors_and_engine_keeps_serving(make_engine):
    engine = make_engine(max_model_len=64)
    too_long = run(engine, prompt(64), rid="long").finished
    assert too_long.finish_reason == "error" and "at most 63" in too_long.error
    assert run(engine, (), rid="empty").finished.finish_reason == "error"
    assert run(engine, (5, 99999), rid="vocab").finished.finish_reason == "error"
    capped = run(engine, prompt(60), SamplingParams(max_tokens=50, ignore_eos=True))
    assert len(capped.token_ids) == 4 and capped.finished.finish_reason == "length"


def test_abort_ends_a_request(make_engine):
    engine = make_engine()
    events, finished = [], threading.Event()

    def on_event(event):
        events.append(event)
        if len(events) == 2:
            engine.abort("long")
        if event.finished:
            finished.set()

    engine.submit(GenerationRequest("long", prompt(20), SamplingParams(max_tokens=4000, ignore_eos=True)), on_event)
    assert finished.wait(60)
    assert events[-1].finish_reason == "abort" and len(events) < 50
    assert run(engine, prompt(20)).finished.finish_reason == "length"
    engine.block_manager.check_integrity()


def test_kv_caches_of_all_layers_move_as_one_transfer_group(make_engine):
    """One allocation for every layer: the transfer layer moves a chunk of all layers with one kernel per slot."""
    from kvshare.transfer import KVLayout
    from kvshare.transfer.blocks import build_block_space

    engine = make_engine()
    layout = KVLayout.from_tensors(engine.kv_caches, kind="packed_kv", block_size=engine.block_size)
    assert len(build_block_space(layout, engine.kv_caches).groups) == 1


def test_the_first_token_leaves_before_the_prompt_s_blocks_are_hashed(make_engine):
    """Entering a prompt's blocks into the prefix cache hashes every block (8,192 at 128k: ~35 ms on an H200 host's
    CPU); it runs after the first token's event is out, so it is not part of TTFT, and before the next step, so the
    cache is complete for the next request (the prefix hit test above)."""
    engine = make_engine()
    events: list[str] = []
    register = engine.block_manager.register_computed

    def recorded(seq):
        events.append(f"register {seq.num_hashed_blocks}")
        register(seq)

    engine.block_manager.register_computed = recorded
    request = GenerationRequest("first", prompt(70), SamplingParams(max_tokens=2, ignore_eos=True))
    engine.submit(request, lambda event: events.append("token" if event.token_id is not None else "finished"))
    deadline = time.monotonic() + 60
    while "finished" not in events and time.monotonic() < deadline:
        time.sleep(0.01)
    assert events[:2] == ["token", "register 0"], events  # the prefill's token, then its 4 full blocks entered
    assert engine.block_manager.hash_to_block and run(engine, prompt(70), rid="again").finished.usage.local_hit_tokens
