"""The limits both HTTP servers put on their clients: one frozen dataclass, and the flags that fill it (the same flags,
with the same defaults, on `kvshare serve` and `kvshare route`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvshare.units import parse_size

DEFAULT_MAX_BODY = "16MiB"  # a 256k-token prompt as JSON token ids is ~2 MiB, as text ~1-6 MiB
DEFAULT_MAX_HEADER = "16KiB"  # h11's own default
DEFAULT_SEND_BUFFER = "256KiB"  # 256 MiB of kernel memory at most for 1024 clients that stop reading


@dataclass(frozen=True)
class HttpLimits:
    """Per connection: how long a client may take and how much it may send.

    Invariants: every field is positive; a server never buffers more than `max_body_bytes` of one request's body
    (plus one read of at most 64 KiB) nor more than `max_header_bytes` of its headers."""

    max_body_bytes: int = parse_size(DEFAULT_MAX_BODY)
    max_header_bytes: int = parse_size(DEFAULT_MAX_HEADER)
    header_timeout_s: float = 10.0  # connection start (or the previous response's end) -> headers complete
    body_timeout_s: float = 30.0  # the longest silence while a request body is incomplete
    write_timeout_s: float = 30.0  # the longest a response waits for a client that does not read
    keep_alive_s: float = 5.0  # an idle kept-alive connection is closed after this
    max_connections: int = 1024  # connections beyond this are answered 503 and closed at once
    send_buffer_bytes: int = parse_size(DEFAULT_SEND_BUFFER)  # the kernel's send buffer of each client socket

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Adds the HTTP client limits to a server command; read them back with `from_args`."""
    d = HttpLimits()
    group = parser.add_argument_group("limits on HTTP clients (see docs/security.md, 'Hostile HTTP clients')")
    group.add_argument("--max-body-size", default=DEFAULT_MAX_BODY, metavar="SIZE",
                       help="largest request body; a larger one gets 413 and no more than this is ever buffered "
                            "(default: %(default)s)")
    group.add_argument("--max-header-size", default=DEFAULT_MAX_HEADER, metavar="SIZE",
                       help="largest request line + headers; larger gets 431 (default: %(default)s)")
    group.add_argument("--header-timeout", type=float, default=d.header_timeout_s, metavar="S",
                       help="seconds a client has to send a request's headers, from connecting or from the end of "
                            "the previous response; then 408 and the connection is closed (default: %(default)s)")
    group.add_argument("--body-timeout", type=float, default=d.body_timeout_s, metavar="S",
                       help="longest silence while a request body is incomplete; then 408 and the connection is "
                            "closed (default: %(default)s)")
    group.add_argument("--write-timeout", type=float, default=d.write_timeout_s, metavar="S",
                       help="longest a response may wait for a client that stopped reading; then the connection is "
                            "dropped and its request aborted (default: %(default)s)")
    group.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_s, metavar="S",
                       help="an idle keep-alive connection is closed after this (default: %(default)s)")
    group.add_argument("--max-connections", type=int, default=d.max_connections, metavar="N",
                       help="open client connections beyond N are answered 503 and closed at once "
                            "(default: %(default)s)")
    group.add_argument("--send-buffer", default=DEFAULT_SEND_BUFFER, metavar="SIZE",
                       help="kernel send buffer of each client connection (SO_SNDBUF): bounds the memory a client "
                            "that stops reading pins, and what is written before --write-timeout starts counting "
                            "(default: %(default)s)")


def from_args(args: argparse.Namespace) -> HttpLimits:
    """Raises ValueError naming the flag's field when a value is unreadable or not positive."""
    return HttpLimits(max_body_bytes=parse_size(args.max_body_size), max_header_bytes=parse_size(args.max_header_size),
                      header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                      write_timeout_s=args.write_timeout, keep_alive_s=args.keep_alive_timeout,
                      max_connections=args.max_connections, send_buffer_bytes=parse_size(args.send_buffer))
