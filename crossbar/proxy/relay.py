"""The body pump: an upstream answer's body streamed to the client with backpressure
(DESIGN.md §The proxy, rules 6-7; §Quality bar).

A :class:`Relay` is the ``IProtocol`` the upstream body is delivered to and the
``IPushProducer`` the client's connection pauses and resumes: each chunk is written to
the client as it arrives, and while the client cannot take more the upstream read
pauses, so memory per stream stays bounded however slow the client is. The idle
timeout (``timeouts.idle``) fires ``timeouts.idle`` seconds after the last body byte,
and is off while the client holds us paused (a slow client is not a silent host). It is
re-armed lazily: a body chunk only records the time it came (no timer work per event,
issue 14); when the timer fires early because bytes came since, it re-arms itself for
what is left.

Its :attr:`Relay.ended` Deferred fires once with how the body ended
(:class:`RelayEnd`); the exchange decides what that means for the client and the host.
"""

from __future__ import annotations

from collections import deque
from enum import Enum
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionLost
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.iweb import IResponse
from twisted.web.server import Request
from zope.interface import implementer

from crossbar.ops.figures import TAIL_BYTES, Figures, read_figures
from crossbar.upstream.failures import describe_failure
from crossbar.upstream.twisted_private import client_is_paused

__all__ = ["Relay", "RelayEnd", "RelayState"]


class RelayState(Enum):
    """Where a relay is."""

    STREAMING = "streaming"
    PAUSED = "paused"  # the client's connection is full: the upstream read is paused
    ENDED = "ended"


class RelayEnd(Enum):
    """How a relayed body ended."""

    COMPLETE = "complete"
    """The host ended the body cleanly."""
    MID_ANSWER = "mid_answer"
    """The host died mid-answer (rule 7): the client must see a truncated answer."""
    IDLE_TIMEOUT = "idle_timeout"
    """No body byte for ``timeouts.idle`` (rule 7)."""
    STOPPED = "stopped"
    """Stopped from our side: the client left, or a drain's grace ran out."""


@implementer(IPushProducer)
class Relay(Protocol):
    """Streams ``response``'s body into ``request``.

    :param request: the client's request (its connection is the consumer).
    :param clock: the reactor (the idle timeout runs on it).
    :param idle_timeout: seconds without a body byte before giving up on the host.
    :ivar bytes: body bytes written to the client so far.
    :ivar reason: for :data:`RelayEnd.MID_ANSWER` and :data:`RelayEnd.IDLE_TIMEOUT`, a
        one-line description of what failed.
    :ivar ended: fires once with the :class:`RelayEnd`; never errbacks.
    :ivar first_byte_at: clock seconds when the first body byte came, or None.

    For the answer's figures (DESIGN.md §What the answers say) the relay keeps
    references to the chunks of the body's last :data:`TAIL_BYTES` (and to its first
    chunk once it left the tail): nothing is copied per chunk; :meth:`figures` reads
    them once, at the end.
    """

    def __init__(self, request: Request, clock: IReactorTime, idle_timeout: float) -> None:
        self.request = request
        self._clock = clock
        self.idle_timeout = idle_timeout
        self.state = RelayState.STREAMING
        self.bytes = 0
        self.reason = ""
        self.ended: Deferred[RelayEnd] = Deferred()
        self.transport: Any = None
        self._timer: IDelayedCall | None = None
        self._last_byte_at = 0.0
        self.first_byte_at: float | None = None
        self._response: IResponse | None = None
        self._tail: deque[bytes] = deque()
        self._tail_bytes = 0
        self._head: bytes | None = None

    def start(self, response: IResponse) -> None:
        """Register with the client's connection and start reading ``response``'s body."""
        self._response = response
        self.request.registerProducer(self, True)
        if client_is_paused(self.request):
            self.pauseProducing()
        if self.state is RelayState.STREAMING:
            self._arm()
        response.deliverBody(self)
        if self.state is RelayState.PAUSED and self.transport is not None:
            # Response.deliverBody resumes the upstream transport once it has handed
            # over, even when a write during the hand-over made the client pause us.
            self.transport.pauseProducing()

    # -- the idle timer -------------------------------------------------------------

    def _arm(self) -> None:
        """Start a whole new idle wait (at start and on resume)."""
        self._disarm()
        self._last_byte_at = self._clock.seconds()
        self._timer = self._clock.callLater(self.idle_timeout, self._idle_check)

    def _disarm(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None and timer.active():
            timer.cancel()

    def _idle_check(self) -> None:
        """The timer fired: time out if no byte came for ``idle_timeout`` seconds, else
        wait for what is left after the last byte."""
        left = self._last_byte_at + self.idle_timeout - self._clock.seconds()
        if left > 0:
            self._timer = self._clock.callLater(left, self._idle_check)
            return
        self._timer = None
        self.timeoutConnection()

    # -- IProtocol: the upstream body ------------------------------------------------

    def makeConnection(self, transport: Any) -> None:
        self.transport = transport
        if self.state is RelayState.PAUSED:
            transport.pauseProducing()

    def dataReceived(self, data: bytes) -> None:
        if self.state is RelayState.ENDED:
            return
        now = self._last_byte_at = self._clock.seconds()
        if not self.bytes:
            self.first_byte_at = now
        self.bytes += len(data)
        tail = self._tail
        tail.append(data)
        self._tail_bytes += len(data)
        if self._tail_bytes - len(tail[0]) >= TAIL_BYTES:
            self._trim()
        self.request.write(data)

    def _trim(self) -> None:
        """Drop the oldest chunks not needed to cover the last :data:`TAIL_BYTES`."""
        tail = self._tail
        while self._tail_bytes - len(tail[0]) >= TAIL_BYTES:
            old = tail.popleft()
            self._tail_bytes -= len(old)
            if self._head is None:
                self._head = old

    def figures(self, path: bytes) -> Figures | None:
        """The answer's figures, read once from the kept tail (call only after a
        :data:`RelayEnd.COMPLETE` end; a cut answer counts nothing). ``path`` is the
        upstream request path. Releases the kept chunks."""
        response, self._response = self._response, None
        if response is None or self.state is not RelayState.ENDED:
            return None
        types = response.headers.getRawHeaders(b"content-type")
        head, self._head = self._head, None
        figures = read_figures(self._tail, types[0] if types else None, path, head is None, head)
        self._tail.clear()
        return figures

    def connectionLost(self, reason: Failure = Failure(ConnectionLost())) -> None:
        if reason.check(ResponseDone, PotentialDataLoss):
            self._end(RelayEnd.COMPLETE)
        else:
            self._end(RelayEnd.MID_ANSWER, f"failed mid-answer: {describe_failure(reason)}")

    def timeoutConnection(self) -> None:
        """No body byte for ``idle_timeout`` seconds: ends with ``IDLE_TIMEOUT`` and
        closes the upstream connection."""
        self._end(RelayEnd.IDLE_TIMEOUT, f"no body byte within {self.idle_timeout:g}s")
        self._close_upstream()

    # -- IPushProducer: the client's connection ------------------------------------

    def pauseProducing(self) -> None:
        if self.state is RelayState.ENDED:
            return
        self.state = RelayState.PAUSED
        self._disarm()
        if self.transport is not None:
            self.transport.pauseProducing()

    def resumeProducing(self) -> None:
        if self.state is RelayState.ENDED:
            return
        self.state = RelayState.STREAMING
        if self.transport is not None:
            self.transport.resumeProducing()
        self._arm()

    def stopProducing(self) -> None:
        self.stop()

    # -- ending ----------------------------------------------------------------------

    def stop(self) -> None:
        """Stop relaying and close the upstream connection (the client left, or crossbar
        is aborting the request). Fires :attr:`ended` with ``STOPPED`` if still running."""
        self._end(RelayEnd.STOPPED)
        self._close_upstream()

    def _close_upstream(self) -> None:
        if self.transport is not None:
            self.transport.stopProducing()

    def _end(self, how: RelayEnd, reason: str = "") -> None:
        if self.state is RelayState.ENDED:
            return
        self.state = RelayState.ENDED
        self._disarm()
        if how is not RelayEnd.COMPLETE:  # a cut answer counts nothing: let its chunks go
            self._tail.clear()
            self._head = self._response = None
        self.reason = reason
        self.ended.callback(how)
