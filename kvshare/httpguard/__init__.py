"""What kvshare's HTTP servers (`kvshare serve`, `kvshare route`) do about hostile clients: `limits` (the flags),
`asgi` (request heads and bodies bounded before an app buffers them), `protocol` (uvicorn's h11 protocol with the
header, body and write timeouts, the send buffer and the connection cap uvicorn lacks), `serve` (runs an ASGI app with
all of them)."""
