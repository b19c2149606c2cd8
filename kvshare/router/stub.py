"""A minimal OpenAI-compatible replica that says who it is: for router tests and the router-overhead benchmark.

`python -m kvshare.router.stub --name A --port 8001` serves /health, /v1/models, /v1/completions and
/v1/chat/completions. Every response (JSON or each SSE event) carries `"replica": NAME` and SSE events a running
`"seq"`, so a test can see where a request went and that a stream arrived whole and in order. A request body may
carry `"stub": {"status": 503}` (answer that status; with `"request_caused": true` also the header by which a replica
marks a failure as the request's own), `{"fail_after": K}` (drop the connection after K events) or
`{"hold_after": K}` (after K events, wait for `POST /stub/release`) or `{"echo_headers": true}` (the request headers
it received, as `"headers": [[name, value], ...]`), optionally with `"only": NAME` so that only the replica of that
name obeys; `POST /stub/health {"ok": false}` makes /health answer 503. A streamed id prompt with
`"return_token_ids": true` gets its ids back in the first event's choice (`prompt_token_ids`), as vLLM sends them.
Bad input (no prompt/messages,
max_tokens < 0, body not JSON) gets an OpenAI-style 400, as a real replica would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvshare.httpguard.errors import ERROR_CAUSE_HEADER, REQUEST_CAUSED


def create_stub_app(name: str, first_token_delay_s: float = 0.0, token_interval_s: float = 0.0) -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    state = {"healthy": True, "requests": 0}
    state["release"] = asyncio.Event()  # POST /stub/release sets it (held streams continue) and arms a fresh one

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"replica": name}, 200 if state["healthy"] else 503)

    @app.post("/stub/health")
    async def set_health(request: Request) -> Response:
        state["healthy"] = bool((await request.json())["ok"])
        return JSONResponse({"replica": name, "healthy": state["healthy"]})

    @app.post("/stub/release")
    async def release_held() -> Response:
        state["release"].set()
        state["release"] = asyncio.Event()
        return JSONResponse({"replica": name})

    @app.get("/stub/state")
    async def stub_state() -> Response:
        return JSONResponse({"replica": name, "healthy": state["healthy"], "requests": state["requests"]})

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "stub", "object": "model", "owned_by": name}]})

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def complete(request: Request) -> Response:
        state["requests"] += 1
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _bad_request("body is not JSON")
        problem = _validate(body)
        if problem:
            return _bad_request(problem)
        control = body.get("stub") or {}
        if control.get("only", name) != name:
            control = {}
        if control.get("status"):
            headers = {ERROR_CAUSE_HEADER: REQUEST_CAUSED} if control.get("request_caused") else {}
            return JSONResponse({"error": {"message": f"stub told to answer {control['status']}"}}, control["status"],
                                headers=headers)
        tokens = int(body.get("max_tokens", 4))
        if body.get("stream"):
            events = _events(name, body, tokens, control, state, first_token_delay_s, token_interval_s)
            return StreamingResponse(events, media_type="text/event-stream")
        await asyncio.sleep(first_token_delay_s)
        text = "".join(f"t{i} " for i in range(tokens))
        echoed = {"headers": [[k, v] for k, v in request.headers.items()]} if control.get("echo_headers") else {}
        return JSONResponse({**_completion(name, body), "choices": [{"index": 0, "text": text}], **_usage(body, tokens),
                             **echoed})

    return app


def _validate(body) -> str:
    if not isinstance(body, dict) or ("prompt" not in body and "messages" not in body):
        return "a completion needs 'prompt' (or 'messages' for chat)"
    if int(body.get("max_tokens", 4)) < 0:
        return f"max_tokens must be >= 0, got {body['max_tokens']}"
    return ""


def _bad_request(message: str) -> Response:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": 400}}, 400)


def _completion(name: str, body: dict) -> dict:
    return {"id": f"stub-{time.monotonic_ns()}", "object": "text_completion", "model": "stub", "replica": name,
            "user": body.get("user")}


def _usage(body: dict, tokens: int) -> dict:
    prompt = body.get("prompt", "")
    prompt_tokens = len(prompt) if isinstance(prompt, (list, str)) else 0
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens, "total_tokens": prompt_tokens + tokens,
             "prompt_tokens_details": {"cached_tokens": 0}}
    return {"usage": usage, "kvshare": {"local_hit_tokens": 0, "pool_hit_tokens": 0}}


async def _events(name, body, tokens, control, state, first_delay_s, interval_s):
    await asyncio.sleep(first_delay_s)
    for seq in range(tokens):
        if seq == control.get("fail_after"):
            raise RuntimeError(f"stub {name} told to fail after {seq} events")
        if seq == control.get("hold_after"):
            await state["release"].wait()
        choice = {"index": 0, "text": f"t{seq} "}
        if seq == 0 and body.get("return_token_ids") and isinstance(body.get("prompt"), list):
            choice["prompt_token_ids"] = body["prompt"]  # as vLLM's first chunk: the prompt's ids, echoed
        event = {**_completion(name, body), "seq": seq, "choices": [choice]}
        yield f"data: {json.dumps(event)}\n\n".encode()
        if interval_s:
            await asyncio.sleep(interval_s)
    final = {**_completion(name, body), "seq": tokens, "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
             **_usage(body, tokens)}
    yield f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode()


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--name", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--first-token-delay-ms", type=float, default=0.0)
    parser.add_argument("--token-interval-ms", type=float, default=0.0)
    args = parser.parse_args(argv)
    app = create_stub_app(args.name, args.first_token_delay_ms / 1000, args.token_interval_ms / 1000)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
