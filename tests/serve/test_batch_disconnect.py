"""A batch request whose client leaves aborts every one of its engine requests, streamed or whole (the merge of the
prompts' streams closes them all, including those still waiting for their next piece)."""

from __future__ import annotations

import httpx
import pytest

from tests.engine.test_server_echo import EchoEngine, serving, wait_for

BODY = {"model": "echo", "prompt": ["abc", "defg", "hi"], "max_tokens": 50_000, "ignore_eos": True}


def test_a_streamed_batch_whose_client_leaves_is_aborted_whole():
    engine = EchoEngine(max_model_len=100_000, delay=0.02)
    with serving(engine) as base:
        with httpx.stream("POST", f"{base}/v1/completions", json={**BODY, "stream": True}, timeout=30) as response:
            received = [line for line, _ in zip(response.iter_lines(), range(6)) if line.startswith("data: ")]
        assert len(received) >= 2
        ids = [request.request_id for request in engine.submitted[-3:]]
        assert len(set(ids)) == 3
        assert wait_for(lambda: set(ids) <= set(engine.aborted)), (ids, engine.aborted)


def test_a_whole_batch_whose_client_leaves_is_aborted_whole():
    engine = EchoEngine(max_model_len=100_000, delay=0.02)
    with serving(engine) as base:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base}/v1/completions", json=BODY, timeout=httpx.Timeout(30, read=0.5))
        ids = [request.request_id for request in engine.submitted[-3:]]
        assert wait_for(lambda: set(ids) <= set(engine.aborted)), (ids, engine.aborted)
        engine.delay = 0.0  # and the server goes on serving
        whole = httpx.post(f"{base}/v1/completions", json={"model": "echo", "prompt": ["ok", "fine"],
                                                          "max_tokens": 4}, timeout=30).json()
        assert [c["text"] for c in whole["choices"]] == ["ok", "fine"]
