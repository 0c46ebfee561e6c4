"""The body pump: an upstream answer's body streamed to the client with backpressure
(docs/design.md §The proxy, rules 6-7; §Quality bar).

A :class:`Relay` is the ``IProtocol`` the upstream body is delivered to and the
``IPushProducer`` the client's connection pauses and resumes: each chunk is written to
the client as it arrives, and while the client cannot take more the upstream read
pauses, so memory per stream stays bounded however slow the client is. The idle
timeout (``timeouts.idle``) fires ``timeouts.idle`` seconds after the last body byte,
and is off while the client holds us paused (a slow client is not a silent host). It is
re-armed lazily: a body chunk only records the time it came (no timer work per event:
CPU per event); when the timer fires early because bytes came since, it re-arms itself for
what is left.

The client stall (``timeouts.client_stall``, rule 7; nginx's ``send_timeout``) is the
other side: a client that takes no byte for that long while crossbar holds bytes for it
(the relay paused because the client's transport is full, or bytes waiting in the
transport) is cut, so that a client that never reads cannot hold a host's slot. Its
timer is reset when the client resumes us; when it fires it asks the transport how many
bytes it still holds (:func:`~crossbar.compat.twisted.pending_write_bytes`):
a client that took some since the last check is slow, not stalled, and gets another
window. No work per body chunk.

Its ``on_end`` is called once with how the body ended (:class:`RelayEnd`); the exchange
decides what that means for the client and the host.
"""

from __future__ import annotations

from collections import deque
from enum import Enum
from typing import Any, Callable

from twisted.internet.error import ConnectionLost
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.iweb import IResponse
from twisted.web.server import Request
from zope.interface import implementer

from crossbar.hosts.health import LifeSign
from crossbar.ops.figures import TAIL_BYTES, Figures, read_figures
from crossbar.upstream.failures import describe_failure
from crossbar.compat.twisted import body_writer, client_is_paused, pending_write_bytes

__all__ = ["Relay", "RelayEnd", "RelayState"]

_LAST_EVENTS = (b"event: message_stop", b"event: response.completed")
"""The server-sent events that end an Anthropic Messages and an OpenAI Responses stream."""


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
    CLIENT_STALL = "client_stall"
    """The client took no byte for ``timeouts.client_stall`` while crossbar held bytes
    for it (rule 7): cut it, cancel upstream, mark nothing."""
    STOPPED = "stopped"
    """Stopped from our side: the client left, or a drain's grace ran out."""


@implementer(IPushProducer)
class Relay(Protocol):
    """Streams ``response``'s body into ``request``.

    :param request: the client's request (its connection is the consumer).
    :param clock: the reactor (the idle timeout runs on it).
    :param idle_timeout: seconds without a body byte before giving up on the host.
    :param client_stall: seconds the client may take no byte crossbar holds for it.
    :param life: where each body chunk notes its time: the host's sign of life
        (:meth:`crossbar.hosts.health.HealthTable.life_sign`, rule 7); None: not kept.
    :param content_type: the answer's ``Content-Type`` value (None: none), which says
        how :meth:`figures` reads the answer's tail.
    :param on_end: called once with the :class:`RelayEnd` when the body ended (a
        direct call, not a Deferred: one per request); None: nobody asks.
    :ivar bytes: body bytes written to the client so far.
    :ivar reason: for :data:`RelayEnd.MID_ANSWER`, :data:`RelayEnd.IDLE_TIMEOUT` and
        :data:`RelayEnd.CLIENT_STALL`, a one-line description of what failed.
    :ivar first_byte_at: clock seconds when the first body byte came, or None.

    For the answer's figures (docs/design.md §What the answers say) the relay keeps
    references to the chunks of the body's last :data:`TAIL_BYTES` (and to its first
    chunk once it left the tail): nothing is copied per chunk; :meth:`figures` reads
    them once, at the end.
    """

    def __init__(self, request: Request, clock: IReactorTime, idle_timeout: float, client_stall: float = 60.0,
                 life: LifeSign | None = None, content_type: bytes | None = None,
                 on_end: Callable[[RelayEnd], None] | None = None) -> None:
        self.request = request
        self._write = request.write  # body_writer's once the head is out (start)
        self.content_type = content_type
        self._clock = clock
        self.idle_timeout = idle_timeout
        self.client_stall = client_stall
        self._life = life
        self._stall_timer: IDelayedCall | None = None
        self._held = False  # at the last stall check (or pause) crossbar held bytes for the client
        self._taken: int | None = None  # bytes the client had taken then (None: unknown)
        self.state = RelayState.STREAMING
        self.bytes = 0
        self.reason = ""
        self.on_end = on_end
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
        self._write = body_writer(self.request)
        self.request.registerProducer(self, True)
        self._arm_stall(held=False)
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
        size = len(data)
        self.bytes += size
        if self._life is not None:
            self._life.at = now  # a sign of life (rule 7)
        tail = self._tail
        tail.append(data)
        kept = self._tail_bytes = self._tail_bytes + size
        if kept - len(tail[0]) >= TAIL_BYTES:
            self._trim()
        self._write(data)

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
        head, self._head = self._head, None
        figures = read_figures(self._tail, self.content_type, path, head is None, head)
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

    # -- the client stall ----------------------------------------------------------

    def _taken_now(self) -> tuple[bool, int | None]:
        """Whether crossbar holds bytes for the client now, and how many body bytes it
        has taken (written minus still held; None when the transport does not say)."""
        pending = pending_write_bytes(self.request)
        if pending is None:
            return self.state is RelayState.PAUSED, None
        return self.state is RelayState.PAUSED or pending > 0, self.bytes - pending

    def _arm_stall(self, held: bool) -> None:
        """Start a whole stall window from now: ``held`` says whether crossbar holds bytes
        for the client at its start (True when it just paused us)."""
        self._disarm_stall()
        self._held = held
        self._taken = self._taken_now()[1] if held else None  # only a held window can end in a cut
        self._stall_timer = self._clock.callLater(self.client_stall, self._stall_check)

    def _disarm_stall(self) -> None:
        timer, self._stall_timer = self._stall_timer, None
        if timer is not None and timer.active():
            timer.cancel()

    def _stall_check(self) -> None:
        """A stall window passed: cut the client if it held bytes all along and took
        none (rule 7), else start another window."""
        self._stall_timer = None
        held, taken = self._taken_now()
        if held and self._held and (taken is None or self._taken is None or taken <= self._taken):
            self._end(RelayEnd.CLIENT_STALL, f"the client took no byte within {self.client_stall:g}s")
            self._close_upstream()
            return
        self._arm_stall(held)

    def delivered_complete(self) -> bool:
        """Whether the body relayed so far is a whole answer as its client can tell:
        as long as the answer's ``Content-Length``, or a stream whose last event ended
        it (``data: [DONE]``, Anthropic's ``message_stop``, the Responses API's
        ``response.completed``). A client that leaves after that saw a complete answer
        (rule 8)."""
        response = self._response
        if response is not None and isinstance(response.length, int):
            return self.bytes >= response.length > 0
        tail = self._tail[-1].rstrip() if self._tail else b""  # the last body chunk
        if tail.endswith(b"data: [DONE]"):
            return True
        if not tail.endswith(b"}"):
            return False
        event = tail[tail.rfind(b"\n\n") + 2:].lstrip() if b"\n\n" in tail else tail
        return event.startswith(_LAST_EVENTS)

    # -- IPushProducer: the client's connection ------------------------------------

    def pauseProducing(self) -> None:
        if self.state is RelayState.ENDED:
            return
        self.state = RelayState.PAUSED
        self._disarm()
        self._arm_stall(held=True)
        if self.transport is not None:
            self.transport.pauseProducing()

    def resumeProducing(self) -> None:
        if self.state is RelayState.ENDED:
            return
        self.state = RelayState.STREAMING
        if self.transport is not None:
            self.transport.resumeProducing()
        self._arm()
        self._arm_stall(held=False)

    def stopProducing(self) -> None:
        self.stop()

    # -- ending ----------------------------------------------------------------------

    def stop(self) -> None:
        """Stop relaying and close the upstream connection (the client left, or crossbar
        is aborting the request). Ends with ``STOPPED`` if still running."""
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
        self._disarm_stall()
        if how is not RelayEnd.COMPLETE and not (how is RelayEnd.STOPPED and self.delivered_complete()):
            # a cut answer counts nothing: let its chunks go (a client that left after the
            # last event of a complete one saw it whole: its figures are still read)
            self._tail.clear()
            self._head = self._response = None
        self.reason = reason
        on_end, self.on_end = self.on_end, None  # no cycle left with the exchange: freed by refcount
        if on_end is not None:
            on_end(how)
