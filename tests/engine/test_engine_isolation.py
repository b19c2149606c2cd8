"""A request whose sampling or model step fails fails alone: the engine (the real one, on the tiny model) finishes it
with an error marked as the request's own, and every other request in flight goes on to the same tokens it would have
produced alone. Before issue 18 one such request failed every request in flight."""

from __future__ import annotations

from kvshare.engine.api import GenerationRequest, SamplingParams
from kvshare.engine.engine import generate

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def prompt(n: int, offset: int = 0) -> tuple[int, ...]:
    return tuple((7 * i + offset) % 1000 + 3 for i in range(n))


def alone(engine, prompt_ids) -> list[int]:
    (result,) = generate(engine, [GenerationRequest("solo", prompt_ids, GREEDY)], timeout=120)
    return result.token_ids


def test_a_request_that_cannot_be_sampled_fails_alone(make_engine):
    """temperature=NaN, as if the server's validation had been bypassed: the sampler cannot draw from NaN."""
    engine = make_engine()
    innocents = [prompt(20, k) for k in range(3)]
    expected = [alone(engine, p) for p in innocents]
    poison = GenerationRequest("poison", prompt(25, 9), SamplingParams(max_tokens=12, temperature=float("nan")))
    requests = [GenerationRequest(f"ok{k}", p, GREEDY) for k, p in enumerate(innocents)]
    results = generate(engine, requests[:2] + [poison] + requests[2:], timeout=120)
    failed = results[2].finished
    assert failed.finish_reason == "error" and failed.request_caused and "sampling failed" in failed.error
    assert [r.token_ids for r in results[:2] + results[3:]] == expected
    assert all(r.finished.finish_reason == "length" for r in results[:2] + results[3:])
    engine.block_manager.check_integrity()


def test_a_decode_step_that_fails_for_one_request_fails_it_alone(make_engine, monkeypatch):
    """A decode step of several requests raises whenever one of them is in it: the engine runs them one at a time,
    fails that one (marked as its own: the others went on) and the others produce their solo tokens."""
    engine = make_engine()
    innocents = [prompt(30, k) for k in range(3)]
    expected = [alone(engine, p) for p in innocents]
    decode = engine.runner.decode

    def decode_refusing_poison(seqs):
        if any(seq.request_id == "poison" for seq in seqs):
            raise RuntimeError("poisoned decode")
        return decode(seqs)

    monkeypatch.setattr(engine.runner, "decode", decode_refusing_poison)
    requests = [GenerationRequest(f"ok{k}", p, GREEDY) for k, p in enumerate(innocents)]
    results = generate(engine, [requests[0], GenerationRequest("poison", prompt(17, 5), GREEDY), *requests[1:]],
                       timeout=120)
    failed = results[1].finished
    assert failed.finish_reason == "error" and failed.request_caused and "poisoned decode" in failed.error
    assert len(results[1].token_ids) == 1  # its prefill's token; its first decode step failed
    assert [r.token_ids for r in results[:1] + results[2:]] == expected
    engine.block_manager.check_integrity()


def test_a_step_that_fails_for_every_request_is_not_blamed_on_a_request(make_engine, monkeypatch):
    """When no request of the step goes on (the only one, or all of them), the replica may be at fault: the failure
    is not marked as the request's own, so a router may retry it elsewhere."""
    engine = make_engine()

    def broken(seqs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "decode", broken)
    results = generate(engine, [GenerationRequest(f"r{k}", prompt(20, k), GREEDY) for k in range(3)], timeout=120)
    assert all(r.finished.finish_reason == "error" and not r.finished.request_caused for r in results)
    assert all("device lost" in r.finished.error for r in results)
    engine.block_manager.check_integrity()
