"""Every place crossbar touches a private Twisted name, fenced in one module.

Each touchpoint says why it is needed; no public API does the same. They were checked
against Twisted 25.5 through 26.10 (:data:`CHECKED`; ``pyproject.toml`` bounds Twisted
to the same range, ``twisted>=25.5,<26.11``, and ``.ci/constraints.txt`` pins 26.10),
and ``tests/test_compat_twisted.py`` fails naming what moved if a Twisted release moves
any of them: take a new Twisted on purpose, after that test and the suite pass.

The start-up check runs once, when this module is imported: :data:`FALLBACK` is None
when the installed Twisted is in :data:`CHECKED` and every private name below is as
expected; otherwise it says why, and every touchpoint does what Twisted itself does
(its bare 400, ``request.write``, its buffered writes, its dispatch loop, its log time
stamps, its request parser): crossbar works, only slower. :func:`log_fallback` says so once at start-up.

Each touchpoint is kept only where the bench shows what it buys (~3% or more of a
request or of an event; 1-4 and 10 are behaviour, not speed). To measure one,
``CROSSBAR_TWISTED_OFF=5,8`` (:data:`OFF`, read at import) switches those touchpoints to
their fallback alone (bench/README.md, "Each Twisted touchpoint, one at a time").

1. :class:`BadRequestHook` overrides ``HTTPChannel._respondToBadRequestAndDisconnect``:
   Twisted's answer to a request it cannot parse is a bare ``400``; crossbar's errors
   are JSON and logged (rules 8-9).
2. :func:`client_is_paused` reads ``HTTPChannel._waitingForTransport``: a producer
   registered on a request whose connection is already full (a pipelined answer before
   it) is told of later pauses only, so the proxy must ask (docs/design.md §Quality bar:
   memory per stream stays bounded).
3. :func:`wrap_port_logger` replaces a listening ``tcp.Port``'s ``_logger`` (a class
   attribute, read in ``doRead``): Twisted logs one line per connection it could not
   accept (``EMFILE``: 350 KB of log in 45 s under a descriptor shortage), and no
   public API filters one port's events (docs/design.md §The proxy, rule 9: at most once a
   minute).
4. :func:`pending_write_bytes` reads ``FileDescriptor.dataBuffer``, ``offset`` and
   ``_tempDataLen`` of the client's TCP transport: whether a client took any byte of
   what crossbar holds for it (``timeouts.client_stall``, docs/design.md §The proxy rule 7).
   Twisted tells a producer only when its buffer is empty again, so a slow client that
   keeps reading would look stalled for as long as one buffer takes to drain.
5. :func:`eager_writes` replaces a TCP transport's ``write``/``writeSequence`` (instance
   attributes) and reads its ``dataBuffer``, ``offset``, ``_tempDataLen`` and
   ``_writeDisconnected``: Twisted buffers every write until the reactor's next turn
   finds the socket writable, which costs each relayed event two ``epoll_ctl`` calls
   and a reactor dispatch (CPU per event) and adds that turn to its latency;
   asyncio sends at once when nothing is waiting, and so does crossbar now. While one
   upstream read is handled (:func:`hold_writes`, :func:`release_writes`) the writes
   it causes are held and sent together at its end: a small answer's head and body
   (and a chunked answer's last chunk) in one ``send`` instead of two or three.
   Switched off: +10% instructions per request, +79% per event.
6. :func:`cache_log_timestamps` replaces ``twisted.logger._file.formatTime``, the module
   global that twistd's text log observer (``textFileLogObserver``) calls for every
   line: it builds a time zone and a ``datetime`` and runs ``strftime`` each time (switched
   off: +60k instructions, 4.5% of a proxied request), though its text changes once
   a second. The replacement gives the same text, formatted once per second; twistd
   offers no other way to choose its observer's time format cheaply (``--logger``
   replaces ``--logfile`` and ``--syslog`` handling altogether).
7. Dropped: the request's log line came with ``log_flattened`` written as
   ``twisted.logger._flatten.flattenEvent`` writes it, so that twistd's text observer
   formatted it without ``string.Formatter``; switched off it cost 0.8% of a request
   (within the count's noise) and nothing per event (bench/README.md, "Each Twisted
   touchpoint, one at a time"). What stays, building the event without ``Logger.emit``
   (:func:`crossbar.ops.emit.emit`), reaches into nothing private.
8. :func:`body_writer` reads ``Request.chunked``, ``_disconnected``, ``_encoder`` and
   ``_inFakeHead`` and adds to ``sentLength``: once an answer's head is out, each relayed
   body chunk went through ``server.Request.write``, ``http.Request.write``, ``toChunk``,
   ``HTTPChannel.writeSequence`` and the transport's ``writeSequence`` (a join): six
   Python calls per streamed event. The writer frames the chunk as ``toChunk`` does
   and hands it to the connection's ``write`` in one call (switched off: +6% per event).
9. :func:`lean_dispatch` replaces an ``EPollReactor``'s ``doIteration`` (an instance
   attribute over the class's ``doPoll``) and reads its ``_poller``, ``_selectables`` and
   ``_doReadOrWrite``, and the reactor thread's ``twisted.python.context`` stack: Twisted
   dispatches every ready descriptor through ``log.callWithLogger``, whose four layers of
   ``*args`` calls and dict copies cost ~7k instructions per read (switched off: +12%
   of a relayed event). The replacement pushes the same log context (the descriptor's
   ``logPrefix()`` as ``system``), logs an escaping error as ``callWithLogger`` does, and
   handles ``epoll_wait`` as ``doPoll`` does, in one loop. That loop also orders a turn:
   upstream connections first, then clients' descriptors within a time budget (the rest
   next turn), so a burst of new requests does not hold running streams' events.
10. :class:`QuietClientService` replaces ``ClientService._log`` (a class attribute) with a
   logger that drops every event: the reconnecting service logs each attempt, so while
   Redis is away (``cluster.redis``) it would write a line a second; the cluster says so
   once instead. Under the fallback it is ``ClientService`` itself.
11. :func:`text_log_file` reads ``LogPublisher._observers`` of the global publisher and
   ``FileLogObserver._outFile``: the file twistd's text log (``--logfile``, or standard
   output) writes to. With ``workers: N`` each worker formats its own text lines, and
   the supervisor appends them to that file as they come (twistd's ``LogFile`` keeps
   rotating by size and on SIGUSR1), or workers write to standard output themselves,
   instead of the supervisor decoding and logging every worker line again (switched
   off: +155k of the supervisor's instructions per proxied request, ~65 µs of its CPU). Under the fallback (or when no
   single text observer is found) the supervisor relays each line as an event, as before.
12. :func:`start_answering`, :func:`answering` and :func:`hold_pipelined` set and read
   ``HTTPChannel._handlingRequest``, ``_savedTimeOut`` and ``_dataBuffer`` as
   ``HTTPChannel.allContentReceived`` and ``rawDataReceived`` do, for crossbar's channel
   that parses request heads with ``httptools`` (llhttp, in C) instead of Twisted's line
   parser (:class:`crossbar.proxy.h1server.H1ServerChannel`): Twisted's own
   ``requestDone``, ``pauseProducing`` and ``resumeProducing`` then go on working as
   they do for Twisted's parser (one request answered at a time, pipelined bytes held
   and replayed, the idle timeout off while answering). Twisted's parser costs tens
   of Python calls per request head, line by line and header by header
   (bench/instructions.sh). Under the fallback (:func:`parsed_heads` is False) that
   channel leaves every byte to Twisted's own parser.
"""

from __future__ import annotations

import errno
import math
import os
import time
from typing import Any, Callable, cast

from twisted.internet.tcp import Connection

from crossbar.compat import start_up_check, within
from twisted.logger import Logger
from twisted.web.http import HTTPChannel
from twisted.web.server import Request

__all__ = ["CHECKED", "FALLBACK", "OFF", "TOUCHPOINTS", "BadRequestHook", "QuietClientService", "body_writer", "cache_log_timestamps", "client_is_paused",
           "eager_writes", "lean_dispatch", "log_fallback", "moved",
           "hold_writes", "pending_write_bytes", "per_second", "release_writes", "text_log_file", "version_checked", "wrap_port_logger",
           "answering", "hold_pipelined", "parsed_heads", "start_answering"]

CHECKED = ((25, 5), (26, 10))
"""The oldest and the newest Twisted (major, minor) the touchpoints were checked against,
both included; ``pyproject.toml``'s bound on Twisted says the same."""


def version_checked(major: int, minor: int) -> bool:
    """Whether Twisted ``major.minor`` is within :data:`CHECKED` (compared as numbers:
    26.1 is older than 26.10)."""
    return within(CHECKED, major, minor)


TOUCHPOINTS = frozenset({1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12})
"""The touchpoints of this module, by their number in its docstring (7 was dropped)."""


def switched_off(text: str) -> frozenset[int]:
    """The touchpoints named in ``text`` (``CROSSBAR_TWISTED_OFF``'s value: numbers
    separated by commas, e.g. ``"5,8"``; empty for none). Raises ``ValueError`` for
    anything else (a number that is not in :data:`TOUCHPOINTS`), so that a mistyped
    measurement fails rather than measures nothing."""
    off = frozenset(int(n) for n in text.replace(" ", "").split(",") if n)
    if not off <= TOUCHPOINTS:
        raise ValueError(f"CROSSBAR_TWISTED_OFF={text!r}: the touchpoints are {sorted(TOUCHPOINTS)}")
    return off


OFF: frozenset[int] = switched_off(os.environ.get("CROSSBAR_TWISTED_OFF", ""))
"""Touchpoints switched off for measurement (``CROSSBAR_TWISTED_OFF=5,8``, read at
import; bench/README.md): each does exactly what it does under :data:`FALLBACK`."""


def _off(touchpoint: int) -> bool:
    """Whether ``touchpoint`` must do what Twisted does: under :data:`FALLBACK`, or
    switched off (:data:`OFF`)."""
    return FALLBACK is not None or touchpoint in OFF


def moved() -> list[str]:
    """The private Twisted names the touchpoints rely on that are not as expected in
    the installed Twisted, each as ``"touchpoint N: name (what)"``; empty when all are.
    Cheap (attribute look-ups, one flattened event): it runs at import."""
    from twisted.internet import abstract, epollreactor, tcp
    from twisted.logger import _file
    from twisted.web import http, server

    found: list[str] = []

    def need(ok: bool, touchpoint: int, name: str, what: str = "it is gone") -> None:
        if not ok:
            found.append(f"touchpoint {touchpoint}: {name} ({what})")

    need(callable(getattr(HTTPChannel, "_respondToBadRequestAndDisconnect", None)), 1,
         "HTTPChannel._respondToBadRequestAndDisconnect")
    need(isinstance(getattr(HTTPChannel(), "_waitingForTransport", None), bool), 2, "HTTPChannel._waitingForTransport")
    need(isinstance(getattr(tcp.Port, "_logger", None), Logger), 3, "tcp.Port._logger", "not a Logger")
    fd: Any = abstract.FileDescriptor(reactor=cast(Any, object()))
    for name in ("dataBuffer", "offset", "_tempDataLen", "_writeDisconnected"):
        need(hasattr(fd, name), 5, f"FileDescriptor.{name}")
    need(callable(getattr(_file, "formatTime", None)), 6, "twisted.logger._file.formatTime")
    for name in ("chunked", "_disconnected", "sentLength", "startedWriting", "finished"):
        need(hasattr(http.Request, name), 8, f"http.Request.{name}")
    for name in ("_encoder", "_inFakeHead"):
        need(hasattr(server.Request, name), 8, f"server.Request.{name}")
    from twisted.application.internet import ClientService

    need(isinstance(getattr(ClientService, "_log", None), Logger), 10, "ClientService._log", "not a Logger")
    from twisted.logger import FileLogObserver, LogPublisher

    need(isinstance(getattr(LogPublisher(), "_observers", None), list), 11, "LogPublisher._observers", "not a list")
    need(getattr(FileLogObserver(cast(Any, None), str), "_outFile", 0) is None, 11, "FileLogObserver._outFile")
    channel: Any = HTTPChannel()
    need(getattr(channel, "_handlingRequest", None) is False, 12, "HTTPChannel._handlingRequest", "not False on a new channel")
    need(getattr(channel, "_dataBuffer", None) == [], 12, "HTTPChannel._dataBuffer", "not an empty list on a new channel")
    need(hasattr(HTTPChannel, "_savedTimeOut"), 12, "HTTPChannel._savedTimeOut")
    reactor_class: Any = epollreactor.EPollReactor
    need(callable(getattr(reactor_class, "_doReadOrWrite", None)), 9, "EPollReactor._doReadOrWrite")
    need(getattr(reactor_class, "doIteration", None) is getattr(reactor_class, "doPoll", 0), 9,
         "EPollReactor.doIteration", "no longer doPoll")
    return found


def _fallback() -> str | None:
    """Why the touchpoints must do what Twisted does (:data:`FALLBACK`), or None."""
    import twisted

    return start_up_check("Twisted", twisted.__version__, CHECKED, moved)


def log_fallback(log: Logger) -> bool:
    """Log, as a warning on ``log``, that the touchpoints fall back to Twisted's own
    behaviour and why; True when they do (the daemon's start-up says it once). Touchpoints
    switched off (:data:`OFF`) are named in a warning of their own."""
    if OFF:
        log.warn("Twisted touchpoints {off} switched off (CROSSBAR_TWISTED_OFF): Twisted's own behaviour there",
                 off=",".join(map(str, sorted(OFF))))
    if FALLBACK is None:
        return False
    log.warn("{why}: using Twisted's own behaviour where crossbar would reach into it (slower, same answers)",
             why=FALLBACK)
    return True


class BadRequestHook:
    """Mix into an ``HTTPChannel`` subclass and define :meth:`respond_to_bad_request`
    (touchpoint 1): it is called instead of Twisted's bare ``400``, and must answer and
    close the connection."""

    def respond_to_bad_request(self) -> None:
        raise NotImplementedError

    def _respondToBadRequestAndDisconnect(self) -> None:
        if _off(1):
            super()._respondToBadRequestAndDisconnect()  # type: ignore[misc]  # Twisted's bare 400
            return
        self.respond_to_bad_request()


def client_is_paused(request: Request) -> bool:
    """Whether the client connection of ``request`` is already full, i.e. a producer
    registered now would not be told to pause (touchpoint 2)."""
    return not _off(2) and bool(getattr(request.channel, "_waitingForTransport", False))


def wrap_port_logger(port: object, wrap: Callable[[Any], Any]) -> bool:
    """Send the log events of the listening ``port`` (a ``twisted.internet.tcp.Port``)
    through ``wrap(its observer)`` (touchpoint 3); returns False, changing nothing, for
    a port without a ``_logger`` (another kind of listener)."""
    logger = getattr(port, "_logger", None)
    if _off(3) or not isinstance(logger, Logger):
        return False
    setattr(port, "_logger", Logger(namespace=logger.namespace, source=logger.source, observer=wrap(logger.observer)))
    return True


def pending_write_bytes(request: Request) -> int | None:
    """Bytes written to the client connection of ``request`` that its transport still
    holds (not yet taken by the kernel), or None when the transport does not say
    (touchpoint 4). A TLS connection's bytes are counted on the TCP transport under it."""
    transport: Any = getattr(request.channel, "transport", None) if not _off(4) else None
    for _ in range(3):  # the channel's transport, or a TLS protocol's TCP transport
        if transport is None:
            return None
        data = getattr(transport, "dataBuffer", None)
        if isinstance(data, bytes):
            return len(data) - int(transport.offset) + int(transport._tempDataLen)
        transport = getattr(transport, "transport", None)
    return None


def eager_writes(transport: Any) -> bool:
    """Make a TCP transport (or the TCP transport under a TLS one) send a write at once
    when nothing is waiting in its buffers, instead of buffering it until the reactor's
    next turn finds the socket writable (touchpoint 5). What the kernel does not take,
    and every write made while bytes are waiting, goes through Twisted's own ``write``
    (its buffer, its producer pausing, its error handling in ``doWrite``). Returns
    False, changing nothing, for a transport that is not a ``tcp.Connection``."""
    if _off(5):
        return False
    for _ in range(2):
        if isinstance(transport, Connection):
            break
        transport = getattr(transport, "transport", None)
    else:
        return False
    tcp: Any = transport
    buffered = tcp.write
    sock = tcp.socket

    def write(data: bytes) -> None:
        held = _held
        if held is not None and type(data) is bytes:  # an upstream read is being handled
            pieces = held.get(write)
            if pieces is None:
                held[write] = [data]
            else:
                pieces.append(data)
            return
        if (data and not tcp._tempDataLen and tcp.offset == len(tcp.dataBuffer) and tcp.connected
                and not tcp.disconnecting and not tcp._writeDisconnected and type(data) is bytes):
            try:
                sent = sock.send(data)
            except OSError:  # EWOULDBLOCK, or an error doWrite will find and report
                sent = 0
            if sent == len(data):
                return
            data = data[sent:]
        buffered(data)

    def write_sequence(iovec: Any) -> None:
        write(b"".join(iovec))

    tcp.write = write
    tcp.writeSequence = write_sequence
    return True


_held: dict[Callable[[bytes], None], list[bytes]] | None = None
"""While an upstream read is handled (:func:`hold_writes`): each eager transport's
writes, by its ``write``, in order."""


def hold_writes() -> bool:
    """Hold what eager transports are given to write until :func:`release_writes`, so
    that what one upstream read makes crossbar write (an answer's head, its body, the
    end of its chunks) goes out in one system call per connection, not one per write:
    a small answer's head and body in one ``send``. True when this call started the
    holding (it must then release it); False when it was already on."""
    global _held
    if _held is not None or FALLBACK is not None or 5 in OFF:  # touchpoint 5's
        return False
    _held = {}
    return True


def release_writes() -> None:
    """Write what was held, each connection's pieces joined into one write, in the
    order the connections were first written to."""
    global _held
    held, _held = _held, None
    if held:
        for write, pieces in held.items():
            write(pieces[0] if len(pieces) == 1 else b"".join(pieces))


def body_writer(request: Request) -> Callable[[bytes], None]:
    """A function that writes one body chunk of ``request``'s answer, once its head is
    out, with the effect of ``request.write`` (touchpoint 8): the same bytes (a chunk's
    ``%x\\r\\n`` size line and ``\\r\\n`` when the answer is chunked) to the same transport,
    ``sentLength`` counted, nothing written to a client that is gone, Twisted's
    ``RuntimeError`` after ``finish``. ``request.write`` itself when the head is not out
    yet, or the answer has no body (a HEAD's, a 204 or 304: Twisted made its ``write`` a
    no-op) or is encoded, or a class on the way overrides a ``write`` this skips."""
    channel: Any = getattr(request, "channel", None)
    if (_off(8) or type(request).write is not Request.write
            or "write" in vars(request)  # HEAD, 204, 304: Twisted made it a no-op with the head
            or not request.startedWriting or request._encoder is not None or request._inFakeHead
            or not isinstance(channel, HTTPChannel) or channel.transport is None
            or type(channel).write is not HTTPChannel.write
            or type(channel).writeSequence is not HTTPChannel.writeSequence):
        return request.write
    fallback = request.write
    transport = channel.transport
    chunked = bool(request.chunked)

    def write(data: bytes) -> None:
        if request.finished or request._disconnected:
            fallback(data)  # Twisted's RuntimeError, or the chunk dropped
            return
        request.sentLength += len(data)
        if data:
            transport.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)

    return write


INCOMING_BUDGET = 0.005
"""Seconds into a reactor turn after which descriptors crossbar did not connect (clients'
connections, the listening port, pipes) wait for the next turn, the upstream
connections' events having gone first (:func:`lean_dispatch`)."""


def lean_dispatch(reactor: Any, clock: Callable[[], float] = time.monotonic) -> bool:
    """Make ``reactor`` (an ``EPollReactor``, Linux's default) dispatch ready descriptors
    without ``log.callWithLogger``'s layers (touchpoint 9), with its effects: while a
    descriptor's ``doRead``/``doWrite`` runs, the legacy log context's ``system`` is its
    ``logPrefix()`` (what ``twisted.python.log.msg`` and ``err`` stamp on events), an
    exception escaping the dispatch is logged with that ``system`` and the loop goes on,
    ``KeyboardInterrupt`` goes through.

    And in one order: when several descriptors are ready, the connections crossbar made
    (``tcp.Client``: upstreams, polls) go first, then the others (clients' connections,
    the listening port) until the turn is :data:`INCOMING_BUDGET` seconds of ``clock``
    old, at least one of them per turn. Those left are reported again by the next
    ``epoll_wait`` (level-triggered), a moment later: a burst of new requests cannot hold
    the events of streams already running for longer than that (docs/design.md §Quality
    bar: a chunk reaches the client without waiting; the lag p99 in a burst).

    Once is enough (returns False the second time, and for any other reactor, changing
    nothing)."""
    from twisted.internet.epollreactor import EPollReactor
    from twisted.internet.tcp import Client
    from twisted.python import context, log

    if (_off(9) or not isinstance(reactor, EPollReactor) or "doIteration" in vars(reactor)
            or type(reactor).doIteration is not EPollReactor.doPoll):
        return False
    poll = reactor._poller.poll
    selectables: dict[int, Any] = reactor._selectables
    dispatch = reactor._doReadOrWrite
    log_context = log.ILogContext
    log_error = log.err

    contexts: list[dict[Any, Any]] = []  # the context stack of the thread running the loop (first_turn)

    def doPoll(timeout: float | None) -> None:
        try:
            events = poll(-1 if timeout is None else timeout, len(selectables))
        except OSError as e:
            if e.errno == errno.EINTR:
                return
            raise
        outer = context.get(log_context)  # the same for every descriptor of this turn
        left, deadline = len(events), 0.0  # left: dispatches before the budget is looked at
        if left > 1:  # the connections crossbar made (upstreams) first; the rest within the budget
            made: list[tuple[int, int]] = []
            rest: list[tuple[int, int]] = []
            for item in events:
                (made if isinstance(selectables.get(item[0]), Client) else rest).append(item)
            if rest:
                events = made + rest
                left, deadline = len(made) + 1, clock() + INCOMING_BUDGET
        for fd, event in events:
            left -= 1
            if left < 0 and clock() > deadline:
                break  # level-triggered: the next epoll_wait reports the rest again
            selectable = selectables.get(fd)
            if selectable is None:
                continue
            try:
                system = selectable.logPrefix()
            except KeyboardInterrupt:
                raise
            except BaseException:
                system = "(buggy logPrefix method)"
                log_error(system=system)
            inner = outer.copy()
            inner["system"] = system
            contexts.append({log_context: inner})
            try:
                try:
                    dispatch(selectable, fd, event)
                finally:
                    contexts.pop()
            except KeyboardInterrupt:
                raise
            except BaseException:
                log_error(system=system)

    def first_turn(timeout: float | None) -> None:
        """Find the context stack of the thread that runs the loop, then turn leanly."""
        nonlocal contexts
        tracker: Any = context.theContextTracker
        contexts = (tracker.currentContext() if hasattr(tracker, "currentContext") else tracker).contexts
        setattr(reactor, "doIteration", doPoll)
        doPoll(timeout)

    setattr(reactor, "doIteration", first_turn)  # mainLoop calls self.doIteration(t)
    return True


def per_second(format_time: Callable[..., str]) -> Callable[..., str]:
    """``format_time`` (:func:`twisted.logger.formatTime`'s signature: ``when`` in epoch
    seconds or None, ``timeFormat``, ``default``), remembering its last text: a time in
    the same second as the last one, in the same format, gets the same text without
    formatting it again. Exact for a format without ``%f`` (the only sub-second
    directive): times within 1 ms of a whole second, where rounding to microseconds
    could move the second, are always formatted."""
    last: list[Any] = [None, None, ""]  # second, format, text

    def formatTime(when: float | None, timeFormat: str | None = "%Y-%m-%dT%H:%M:%S%z", default: str = "-") -> str:
        if when is None or timeFormat is None or "%f" in timeFormat:
            return format_time(when, timeFormat, default)
        second = math.floor(when)
        if not 0.001 <= when - second <= 0.999:
            return format_time(when, timeFormat, default)
        if last[0] == second and last[1] == timeFormat:
            return last[2]
        text = format_time(when, timeFormat, default)
        last[0], last[1], last[2] = second, timeFormat, text
        return text

    formatTime.crossbar_per_second = True  # type: ignore[attr-defined]
    return formatTime


def cache_log_timestamps() -> bool:
    """Make twistd's text log observer format its time stamp once per second (touchpoint
    6); the lines are the same. Returns False, changing nothing, when Twisted's
    ``twisted.logger._file`` has no ``formatTime`` (or it was already replaced)."""
    from twisted.logger import _file

    original = getattr(_file, "formatTime", None)
    if _off(6) or not callable(original) or getattr(original, "crossbar_per_second", False):
        return False
    setattr(_file, "formatTime", per_second(original))
    return True


def text_log_file(publisher: Any = None) -> Any:
    """The file the one :class:`twisted.logger.FileLogObserver` among ``publisher``'s
    (default: the global log publisher's) observers writes to (touchpoint 11): twistd's
    text log, a :class:`twisted.python.logfile.LogFile` for ``--logfile``, else its
    standard output. None under the fallback, or when there is no such observer or more
    than one."""
    from twisted.logger import FileLogObserver, globalLogPublisher

    if _off(11):
        return None
    observers = getattr(globalLogPublisher if publisher is None else publisher, "_observers", ())
    found = [o for o in observers if isinstance(o, FileLogObserver)]
    return getattr(found[0], "_outFile", None) if len(found) == 1 else None


FALLBACK: str | None = _fallback()
"""None when every touchpoint may reach into Twisted; else why each does what Twisted
itself does (the start-up check, run once at import)."""


def _quiet_client_service() -> type:
    from twisted.application.internet import ClientService
    from twisted.logger import LogPublisher

    if _off(10):
        return ClientService

    class QuietClientService(ClientService):
        """A reconnecting ``ClientService`` that logs nothing per attempt (touchpoint 10)."""

        _log = Logger(observer=LogPublisher())  # no observers: every event dropped

    return QuietClientService


QuietClientService: Any = _quiet_client_service()
"""Twisted's ``ClientService`` without a log line per connection attempt (touchpoint 10)."""


def parsed_heads() -> bool:
    """Whether crossbar's channel may parse request heads itself (touchpoint 12): False
    under the fallback or switched off (:data:`OFF`), and the channel then leaves every
    byte to Twisted's parser."""
    return not _off(12)


def start_answering(channel: HTTPChannel) -> None:
    """What ``HTTPChannel.allContentReceived`` does to ``channel`` once a request is
    complete, before it is handed to its ``Request`` (touchpoint 12): the idle timeout
    saved and switched off, the channel marked as answering (bytes that arrive
    meanwhile are held, and the transport is not paused by the channel's consumer
    side); Twisted's ``requestDone`` undoes both."""
    if channel.timeOut:
        channel._savedTimeOut = channel.setTimeout(None)
    channel._handlingRequest = True


def answering(channel: HTTPChannel) -> bool:
    """Whether ``channel`` is answering a request (between :func:`start_answering` and
    Twisted's ``requestDone``; touchpoint 12)."""
    return bool(channel._handlingRequest)


def hold_pipelined(channel: HTTPChannel, data: bytes) -> None:
    """Hold ``data`` (bytes after a request, received while it is answered) as
    ``HTTPChannel.rawDataReceived`` does: Twisted's ``requestDone`` hands them back to
    ``channel.dataReceived``; over 16 KiB held, the transport is paused (touchpoint 12)."""
    HTTPChannel.rawDataReceived(channel, data)
