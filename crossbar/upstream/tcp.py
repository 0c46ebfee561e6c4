"""TCP socket options crossbar sets on every connection it makes or accepts."""

from __future__ import annotations

from typing import Any

__all__ = ["no_delay"]


def no_delay(transport: Any) -> None:
    """Turn Nagle's algorithm off on ``transport`` when it is a TCP connection.

    A proxied request's head and body, and every event of a stream, are separate small
    writes. With Nagle on, each waits for the peer's delayed ACK (up to 40 ms on
    Linux): requests stall and stream events coalesce (docs/design.md §Quality bar: a chunk
    reaches the client without waiting for the next one). Other transports (UNIX
    sockets, TLS wrappers without the method) are left alone.
    """
    set_no_delay = getattr(transport, "setTcpNoDelay", None)
    if set_no_delay is None:
        return
    try:
        set_no_delay(True)
    except OSError:
        pass  # not a TCP socket after all, or already closed
