"""`kvshare serve` as a real process on the tiny model: it answers completions and chat, and stops cleanly."""

import subprocess
import sys
import time

import httpx
import pytest

from kvshare.processes import free_port


@pytest.fixture
def server(tiny_model):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvshare.cli", "serve", "--model", str(tiny_model), "--port",
                             str(port), "--num-blocks", "128", "--threads", "1", "--served-model-name", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):  # bounded: 60 s
            if proc.poll() is not None:
                raise RuntimeError(f"kvshare serve exited: {proc.stdout.read().decode()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        else:
            raise TimeoutError("kvshare serve did not become healthy in 60 s")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_serve_answers_completions_and_chat(server):
    body = {"model": "tiny", "prompt": "The cat sat on the mat. " * 3, "max_tokens": 5, "temperature": 0}
    first = httpx.post(server + "/v1/completions", json=body, timeout=60).json()
    again = httpx.post(server + "/v1/completions", json=body, timeout=60).json()
    assert first["choices"][0]["text"] == again["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the local prefix cache hit
    chat = httpx.post(server + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
