"""A real `kvshare serve` process on the session's tiny model, shared by a test module, and small HTTP helpers."""

from __future__ import annotations

import json

import httpx
import pytest

from kvshare.processes import ServerProcess, free_port, kvshare_argv

MAX_MODEL_LEN = 256
MODEL = "tiny"
MAX_LOGPROBS, MAX_PROMPTS = 5, 4  # below the defaults, so that tests reach the limits cheaply


def kvshare_serve(model_dir, *extra: str) -> ServerProcess:
    port = free_port()
    return ServerProcess(kvshare_argv("serve", "--model", str(model_dir), "--port", str(port), "--threads", "1",
                                      "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", MODEL, *extra),
                         port, name="replica")


@pytest.fixture(scope="module")
def url(tiny_model):
    server = kvshare_serve(tiny_model, "--max-logprobs", str(MAX_LOGPROBS), "--max-prompts", str(MAX_PROMPTS))
    server.start(ready_timeout_s=120)
    try:
        yield server.url
    finally:
        server.stop()


def post(url: str, path: str, **body) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=60)


def stream(url: str, path: str, **body) -> list[dict]:
    """The SSE events of a streamed request (the [DONE] line checked and dropped)."""
    with httpx.stream("POST", f"{url}{path}", json={"model": MODEL, "stream": True, **body}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]
