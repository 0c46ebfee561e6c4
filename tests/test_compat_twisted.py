"""Pins every private Twisted touchpoint listed in crossbar/compat/twisted.py.

Each touchpoint has two kinds of test: the private names exist with the expected kind
and do what crossbar relies on (these fail with a message naming the Twisted internal
that moved), and a behaviour check through crossbar's public function. A failure here
after a Twisted upgrade means: read crossbar/compat/twisted.py, adapt the touchpoint,
then raise its CHECKED range, pyproject.toml's bound and the pin in .ci/constraints.txt.
"""

from __future__ import annotations

import inspect
import io
import os
import socket
from typing import Any, Callable

import twisted
from twisted.internet import reactor
from twisted.internet.abstract import FileDescriptor
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Protocol
from twisted.internet.task import Clock, deferLater
from twisted.internet.tcp import Connection
from twisted.internet.testing import MemoryReactor, StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.http import HTTPChannel
from twisted.web.server import Request, Site
from twisted.web.test.requesthelper import DummyChannel, DummyRequest
from zope.interface import implementer

from crossbar.compat.twisted import BadRequestHook, body_writer, client_is_paused, eager_writes, pending_write_bytes
from tests.fakes import HoldResource


def moved(name: str, touchpoint: int, what: str) -> str:
    return (
        f"Twisted {twisted.__version__} changed {name} ({what}): crossbar/compat/twisted.py "
        f"touchpoint {touchpoint} relies on it; adapt it before taking this Twisted"
    )


class _Private(SynchronousTestCase):
    def require_attribute(self, owner: Any, name: str, touchpoint: int, kind: str = "method") -> Any:
        """``owner.name`` exists (and is callable when ``kind`` is "method")."""
        label = f"{getattr(owner, '__module__', '')}.{getattr(owner, '__qualname__', type(owner).__name__)}.{name}"
        if not hasattr(owner, name):
            self.fail(moved(label, touchpoint, "it is gone"))
        value = getattr(owner, name)
        if kind == "method" and not callable(value):
            self.fail(moved(label, touchpoint, f"no longer a method: {value!r}"))
        return value


# -- touchpoint 1: HTTPChannel._respondToBadRequestAndDisconnect ----------------------------




def _serve(protocol: type[HTTPChannel]) -> tuple[HTTPChannel, StringTransport, HoldResource]:
    resource = HoldResource()
    site = Site(resource, reactor=Clock())
    site.protocol = protocol  # type: ignore[assignment]
    channel = site.buildProtocol(None)
    assert isinstance(channel, HTTPChannel)
    transport = StringTransport()
    channel.makeConnection(transport)
    return channel, transport, resource


class _Counting(HTTPChannel):
    bad = 0

    def _respondToBadRequestAndDisconnect(self) -> None:
        self.bad += 1
        assert self.transport is not None
        self.transport.loseConnection()


class _Hooked(BadRequestHook, HTTPChannel):
    bad = 0

    def respond_to_bad_request(self) -> None:
        self.bad += 1
        assert self.transport is not None
        self.transport.write(b"HOOKED")
        self.transport.loseConnection()


class BadRequestTouchpointTests(_Private):
    def test_name_exists(self) -> None:
        self.require_attribute(HTTPChannel, "_respondToBadRequestAndDisconnect", 3)
        params = list(inspect.signature(HTTPChannel._respondToBadRequestAndDisconnect).parameters)
        self.assertEqual(params, ["self"], moved("HTTPChannel._respondToBadRequestAndDisconnect", 1, f"signature {params}"))

    def test_called_for_unparsable_requests(self) -> None:
        for data in (
            b"NOT-HTTP\r\n\r\n",
            b"GET / HTTP/1.1\r\nno colon\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        ):
            channel, transport, resource = _serve(_Counting)
            channel.dataReceived(data)
            self.assertEqual(
                channel.bad, 1,  # type: ignore[attr-defined]
                moved("HTTPChannel._respondToBadRequestAndDisconnect", 1, f"not called for {data!r}"),
            )
            self.assertEqual(resource.requests, [])
            self.assertEqual(transport.value(), b"")  # nothing but the override answered

    def test_bad_request_hook(self) -> None:
        """Behaviour through :class:`BadRequestHook`: its ``respond_to_bad_request``
        answers instead of Twisted's bare 400."""
        channel, transport, _ = _serve(_Hooked)
        channel.dataReceived(b"NOT-HTTP\r\n\r\n")
        self.assertEqual(channel.bad, 1)  # type: ignore[attr-defined]
        self.assertEqual(transport.value(), b"HOOKED")
        self.assertTrue(transport.disconnecting)

    def test_good_request_does_not_call_it(self) -> None:
        channel, _, resource = _serve(_Hooked)
        channel.dataReceived(b"GET /r HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(channel.bad, 0)  # type: ignore[attr-defined]
        self.assertEqual(len(resource.requests), 1)

    def test_hook_must_be_defined(self) -> None:
        self.assertRaises(NotImplementedError, BadRequestHook().respond_to_bad_request)


# -- touchpoint 2: HTTPChannel._waitingForTransport ----------------------------------------------


class WaitingForTransportTests(_Private):
    def test_flips_with_the_transport(self) -> None:
        channel, _, _ = _serve(HTTPChannel)
        name = "HTTPChannel._waitingForTransport"
        self.assertIs(getattr(channel, "_waitingForTransport", None), False, moved(name, 2, "not False at first"))
        channel.pauseProducing()  # what the TCP transport does when its buffer fills
        self.assertIs(channel._waitingForTransport, True, moved(name, 2, "not set by pauseProducing"))
        channel.resumeProducing()
        self.assertIs(channel._waitingForTransport, False, moved(name, 2, "not cleared by resumeProducing"))

    def test_late_producer_is_not_told(self) -> None:
        """Why the touchpoint exists: a producer registered while the channel is paused
        is not told to pause (if Twisted starts telling it, client_is_paused may go)."""
        channel, _, resource = _serve(HTTPChannel)
        channel.dataReceived(b"GET /r HTTP/1.1\r\nHost: x\r\n\r\n")
        channel.pauseProducing()
        paused: list[bool] = []

        class _Producer:
            def pauseProducing(self) -> None: paused.append(True)
            def resumeProducing(self) -> None: paused.append(False)
            def stopProducing(self) -> None: ...

        resource.requests[0].registerProducer(_Producer(), True)
        self.assertEqual(paused, [], "Twisted now pauses a producer registered on a paused channel: "
                                     "crossbar/compat/twisted.py touchpoint 2 may be dropped")

    def test_client_is_paused(self) -> None:
        """Behaviour through :func:`client_is_paused`."""
        channel, _, resource = _serve(HTTPChannel)
        channel.dataReceived(b"GET /r HTTP/1.1\r\nHost: x\r\n\r\n")
        [request] = resource.requests
        self.assertFalse(client_is_paused(request))
        channel.pauseProducing()
        self.assertTrue(client_is_paused(request))
        channel.resumeProducing()
        self.assertFalse(client_is_paused(request))
        channel.connectionLost(Failure(ConnectionDone()))

    def test_client_is_paused_without_the_attribute(self) -> None:
        """A request whose channel is no HTTPChannel (a test double) reads as not paused."""
        request = DummyRequest([b""])
        request.channel = DummyChannel()
        self.assertFalse(client_is_paused(request))  # type: ignore[arg-type]


class VersionTests(SynchronousTestCase):
    def test_pyproject_bounds_twisted_to_the_checked_range(self) -> None:
        """``pyproject.toml`` lets pip take only a Twisted the touchpoints were checked
        against (CHECKED), and the installed one is such a Twisted."""
        import pathlib
        import tomllib

        from packaging.requirements import Requirement

        from crossbar.compat.twisted import CHECKED

        with open(pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
            deps = tomllib.load(f)["project"]["dependencies"]
        (twisted_req,) = [Requirement(d) for d in deps if Requirement(d).name.lower() == "twisted"]
        spec = twisted_req.specifier
        (low_major, low_minor), (high_major, high_minor) = CHECKED
        for inside in (f"{low_major}.{low_minor}.0", f"{high_major}.{high_minor}.0", f"{high_major}.{high_minor}.9"):
            self.assertIn(inside, spec, f"pyproject.toml's {spec} refuses {inside}, which CHECKED covers")
        for outside in (f"{low_major}.{low_minor - 1}.9" if low_minor else f"{low_major - 1}.99.0",
                        f"{high_major}.{high_minor + 1}.0", f"{high_major + 1}.0.0"):
            self.assertNotIn(outside, spec, f"pyproject.toml's {spec} lets pip take {outside}, never checked")
        self.assertIn(twisted.__version__, spec)

    def test_versions_compare_as_numbers(self) -> None:
        """26.1 and 26.4 are within 25.5-26.10; 26.11 and 25.4 are not (a substring match
        of "26.10" would say otherwise)."""
        from crossbar.compat.twisted import version_checked

        self.assertEqual([version_checked(*v) for v in ((25, 5), (26, 1), (26, 4), (26, 10))], [True] * 4)
        self.assertEqual([version_checked(*v) for v in ((25, 4), (26, 11), (27, 0), (3, 0))], [False] * 4)

    def test_this_twisted_needs_no_fallback(self) -> None:
        from crossbar.compat.twisted import FALLBACK, moved

        self.assertEqual(moved(), [])
        self.assertIsNone(FALLBACK)

    def test_moved_names_the_touchpoint(self) -> None:
        from crossbar.compat.twisted import moved

        self.patch(HTTPChannel, "_respondToBadRequestAndDisconnect", None)
        from twisted.internet import tcp

        self.patch(tcp.Port, "_logger", "not a logger")
        self.assertEqual(moved(), [
            "touchpoint 1: HTTPChannel._respondToBadRequestAndDisconnect (it is gone)",
            "touchpoint 3: tcp.Port._logger (not a Logger)",
        ])


class FallbackTests(SynchronousTestCase):
    """With the start-up check failed (an unchecked Twisted, or a moved name), every
    touchpoint does what Twisted itself does and changes nothing of Twisted's."""

    def setUp(self) -> None:
        import crossbar.compat.twisted as module

        self.module = module
        self.patch(module, "FALLBACK", "Twisted 99.1 is outside the range")

    def test_request_path_touchpoints_are_twisteds_own(self) -> None:
        request = DummyRequest([b""])
        self.assertFalse(client_is_paused(request))  # type: ignore[arg-type]
        self.assertIsNone(pending_write_bytes(request))  # type: ignore[arg-type]
        self.assertFalse(eager_writes(StringTransport()))
        from twisted.internet import tcp

        port = tcp.Port(0, None)
        self.assertFalse(self.module.wrap_port_logger(port, lambda o: o))
        self.assertNotIn("_logger", vars(port))
        answer, _ = BodyWriterTouchpointTests("test_names_exist")._answer(b"GET /r HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(body_writer(answer), answer.write)

    def test_heads_are_left_to_twisteds_parser(self) -> None:
        self.assertFalse(self.module.parsed_heads())

    def test_bad_request_is_twisteds_bare_400(self) -> None:
        channel, transport, _ = _serve(_Hooked)
        channel.dataReceived(b"NOT-HTTP\r\n\r\n")
        self.assertEqual(channel.bad, 0)  # type: ignore[attr-defined]
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 400 Bad Request"), transport.value())

    def test_reactor_and_log_touchpoints_change_nothing(self) -> None:
        from twisted.internet.epollreactor import EPollReactor
        from twisted.logger import _file

        r = EPollReactor()
        self.addCleanup(r._poller.close)
        self.assertFalse(self.module.lean_dispatch(r))
        self.assertNotIn("doIteration", vars(r))
        before = _file.formatTime
        self.assertFalse(self.module.cache_log_timestamps())
        self.assertIs(_file.formatTime, before)
        self.assertFalse(self.module.hold_writes())  # nothing is ever held
        from twisted.logger import LogPublisher, textFileLogObserver

        self.assertIsNone(self.module.text_log_file(LogPublisher(textFileLogObserver(io.StringIO()))))

    def test_said_once_at_start_up(self) -> None:
        from twisted.logger import Logger

        events: list[dict[str, Any]] = []
        self.assertTrue(self.module.log_fallback(Logger(namespace="crossbar", observer=events.append)))
        self.assertEqual(len(events), 1)
        self.assertIn("Twisted 99.1 is outside the range", events[0]["why"])
        self.patch(self.module, "FALLBACK", None)
        self.assertFalse(self.module.log_fallback(Logger(namespace="crossbar", observer=events.append)))


class SwitchedOffTests(FallbackTests):
    """``CROSSBAR_TWISTED_OFF`` (:data:`OFF`), for measurement: a touchpoint switched off
    does exactly what it does under the fallback; the others stay on."""

    def setUp(self) -> None:
        import crossbar.compat.twisted as module

        self.module = module
        self.patch(module, "OFF", frozenset(module.TOUCHPOINTS))

    def test_said_once_at_start_up(self) -> None:
        from twisted.logger import Logger

        events: list[dict[str, Any]] = []
        self.patch(self.module, "OFF", frozenset({5, 8}))
        self.assertFalse(self.module.log_fallback(Logger(namespace="crossbar", observer=events.append)))
        self.assertEqual([e["off"] for e in events], ["5,8"])

    def test_one_at_a_time(self) -> None:
        self.patch(self.module, "OFF", frozenset({8}))
        self.assertTrue(self.module.hold_writes())  # touchpoint 5 is on
        self.module.release_writes()
        answer, _ = BodyWriterTouchpointTests("test_names_exist")._answer(b"GET /r HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(body_writer(answer), answer.write)
        self.patch(self.module, "OFF", frozenset({5}))
        self.assertFalse(self.module.hold_writes())
        self.assertNotEqual(body_writer(answer), answer.write)

    def test_read_from_the_environment_at_import(self) -> None:
        import subprocess
        import sys

        code = "import crossbar.compat.twisted as t; print(sorted(t.OFF), t.FALLBACK)"
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        for value, printed in (("5,8", "[5, 8] None"), ("", "[] None"), (" 11 ", "[11] None")):
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                 env=dict(os.environ, CROSSBAR_TWISTED_OFF=value, PYTHONPATH=root))
            self.assertEqual(out.stdout.strip(), printed)
        self.assertEqual(self.module.switched_off("9, 6"), frozenset({6, 9}))
        for wrong in ("13", "0", "7", "five", "5;8"):  # 7 was dropped
            self.assertRaises(ValueError, self.module.switched_off, wrong)


class PortLoggerTouchpointTests(_Private):
    def test_port_logs_accept_errors_through_its_logger(self) -> None:
        """Touchpoint 3: ``tcp.Port._logger`` is a ``Logger`` and ``doRead`` logs accept
        errors through the instance's logger (its namespace and observer)."""
        from twisted.internet import tcp
        from twisted.logger import Logger

        self.require_attribute(tcp.Port, "_logger", 3, kind="attribute")
        self.assertIsInstance(tcp.Port._logger, Logger, moved("tcp.Port._logger", 3, "not a Logger"))
        source = inspect.getsource(tcp.Port.doRead)
        self.assertIn("self._logger.observer", source, moved("tcp.Port.doRead", 3, "no longer logs via _logger"))
        self.assertIn("EMFILE", inspect.getsource(tcp._accept), moved("tcp._accept", 3, "EMFILE lines changed"))


# -- touchpoint 4: FileDescriptor.dataBuffer, offset, _tempDataLen ---------------------------------


class _Kernel(FileDescriptor):
    """A TCP transport whose kernel takes at most ``take`` bytes per write."""

    take = 4

    def writeSomeData(self, data: bytes) -> int:
        return min(len(data), self.take)


class PendingWriteBytesTests(_Private):
    def test_counts_what_the_transport_still_holds(self) -> None:
        name = "FileDescriptor.dataBuffer/offset/_tempDataLen"
        fd = _Kernel(reactor=MemoryReactor())  # type: ignore[no-untyped-call]
        fd.connected = 1
        request: Any = DummyRequest([b""])
        request.channel = type("Channel", (), {"transport": fd})()
        self.assertEqual(pending_write_bytes(request), 0, moved(name, 4, "not 0 at first"))
        fd.write(b"x" * 10)
        self.assertEqual(pending_write_bytes(request), 10, moved(name, 4, "a write not counted"))
        fd.doWrite()  # the kernel took 4
        self.assertEqual(pending_write_bytes(request), 6, moved(name, 4, "bytes taken still counted"))
        fd.write(b"y" * 5)
        fd.doWrite()
        self.assertEqual(pending_write_bytes(request), 7, moved(name, 4, "buffers not added up"))

    def test_a_transport_that_does_not_say(self) -> None:
        request: Any = DummyRequest([b""])
        request.channel = type("Channel", (), {"transport": StringTransport()})()
        self.assertIsNone(pending_write_bytes(request))


# -- touchpoint 5: tcp.Connection write buffers, eager_writes ---------------------------------


class _Sink(Protocol):
    def __init__(self) -> None:
        self.transport_ready: Deferred[Any] = Deferred()

    def connectionMade(self) -> None:
        self.transport_ready.callback(self.transport)


class EagerWritesTests(TestCase):
    """A real TCP connection on 127.0.0.1: what the kernel takes goes out at once, what it
    does not goes through Twisted's buffer, in order, with the producer paused."""

    def test_names_exist(self) -> object:
        async def go() -> None:
            transport, _ = await self._connected()
            self.assertIsInstance(transport, Connection, moved("twisted.internet.tcp.Connection", 5, "not the transport"))
            for name in ("dataBuffer", "offset", "_tempDataLen", "_writeDisconnected", "disconnecting", "connected"):
                if not hasattr(transport, name):
                    self.fail(moved(f"twisted.internet.tcp.Connection.{name}", 5, "it is gone"))
        return ensureDeferred(go())

    def test_not_a_tcp_transport(self) -> None:
        self.assertFalse(eager_writes(StringTransport()))

    async def _connected(self) -> tuple[Any, socket.socket]:
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        self.addCleanup(server.close)
        sink = _Sink()
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", server.getsockname()[1])
        await connectProtocol(endpoint, sink)
        transport = await sink.transport_ready
        self.addCleanup(transport.abortConnection)
        peer, _ = server.accept()
        self.addCleanup(peer.close)
        peer.setblocking(False)
        return transport, peer

    def test_held_writes_go_out_together_at_release(self) -> object:
        """While held (an upstream read being handled), writes wait and then go out
        joined, one write per connection, in order; held again inside: one holding."""
        from crossbar.compat.twisted import hold_writes, release_writes

        async def go() -> None:
            first, first_peer = await self._connected()
            second, second_peer = await self._connected()
            self.assertTrue(eager_writes(first) and eager_writes(second))
            self.assertTrue(hold_writes())
            try:
                self.assertFalse(hold_writes(), "already holding")
                first.write(b"HTTP/1.1 200 OK\r\n\r\n")
                second.write(b"x")
                first.writeSequence([b"{", b"}"])
                self.assertRaises(BlockingIOError, first_peer.recv, 100)  # nothing sent yet
            finally:
                release_writes()
            self.assertEqual(first_peer.recv(100), b"HTTP/1.1 200 OK\r\n\r\n{}")
            self.assertEqual(second_peer.recv(100), b"x")
            first.write(b"after")  # not held: at once
            self.assertEqual(first_peer.recv(100), b"after")
        return ensureDeferred(go())

    def test_a_write_goes_out_before_the_reactor_turns(self) -> object:
        async def go() -> None:
            transport, peer = await self._connected()
            self.assertTrue(eager_writes(transport))
            transport.write(b"data: 1\n\n")
            transport.writeSequence([b"a", b"b"])
            self.assertEqual(peer.recv(100), b"data: 1\n\nab")  # no reactor turn in between
            self.assertEqual(transport.dataBuffer[transport.offset:], b"")
        return ensureDeferred(go())

    def test_what_the_kernel_does_not_take_is_buffered_in_order(self) -> object:
        async def go() -> None:
            transport, peer = await self._connected()
            eager_writes(transport)
            transport.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            paused: list[bool] = []

            @implementer(IPushProducer)
            class Producer:
                def pauseProducing(self) -> None:
                    paused.append(True)

                def resumeProducing(self) -> None:
                    paused.append(False)

                def stopProducing(self) -> None:
                    pass

            transport.registerProducer(Producer(), True)
            blob = bytes(range(256)) * 4096  # 1 MiB: far more than the socket takes at once
            transport.write(blob)
            transport.write(b"tail")
            self.assertGreater(transport._tempDataLen + len(transport.dataBuffer) - transport.offset, 0)
            self.assertEqual(paused[:1], [True])  # over Twisted's bufferSize: the producer is paused
            got = bytearray()
            while len(got) < len(blob) + 4:
                try:
                    got += peer.recv(1 << 20)
                except BlockingIOError:
                    await deferLater(reactor, 0.001, lambda: None)
            self.assertEqual(bytes(got), blob + b"tail")
            self.assertEqual(paused[-1], False)  # resumed once the buffer drained
        return ensureDeferred(go())


# -- touchpoint 6: twisted.logger._file.formatTime ----------------------------------------


def _times() -> list[float | None]:
    """Times in order, backwards, repeated, near and on whole seconds, and None."""
    import random

    rng = random.Random(6)
    base = 1_796_181_777.0
    out: list[float | None] = [base, base + 0.0004, base + 0.9996, base + 0.999_999_7, base + 1.0, None, 0.5, -1.25]
    at = base
    for _ in range(2000):
        at += rng.choice([0.0, 0.000_01, 0.0003, 0.01, 0.3, 0.999, 1.0, 7.2, -0.5, -3.0])
        out.append(at)
    return out


class LogTimestampTouchpointTests(_Private):
    def test_the_observer_calls_the_module_global(self) -> None:
        from twisted.logger import _file

        self.require_attribute(_file, "formatTime", 6, "method")
        source = inspect.getsource(_file.textFileLogObserver)
        if "formatTime(e, timeFormat)" not in source:
            self.fail(moved("twisted.logger._file.textFileLogObserver", 6, "it no longer calls formatTime(e, timeFormat)"))

    def test_same_text_as_twisted_for_every_time_and_format(self) -> None:
        from twisted.logger import formatTime, timeFormatRFC3339

        from crossbar.compat.twisted import per_second

        cached = per_second(formatTime)
        for time_format in (timeFormatRFC3339, "%Y-%m-%d %H:%M:%S", "%H:%M:%S.%f", "%S", None):
            for when in _times():
                self.assertEqual(cached(when, time_format), formatTime(when, time_format), (when, time_format))

    def test_lines_of_twisteds_text_observer_unchanged(self) -> None:
        import io

        from twisted.logger import LogLevel, _file, textFileLogObserver

        from crossbar.compat.twisted import cache_log_timestamps

        def lines() -> str:
            out = io.StringIO()
            observe = textFileLogObserver(out)
            for n, when in enumerate(_times()[:500]):
                observe({"log_format": "{n} at {when}", "n": n, "when": when, "log_time": when,
                         "log_level": LogLevel.info, "log_namespace": "crossbar.test"})
            return out.getvalue()

        plain = lines()
        self.patch(_file, "formatTime", _file.formatTime)  # restored after the test
        self.assertTrue(cache_log_timestamps())
        self.assertFalse(cache_log_timestamps(), "replaced once only")
        self.assertTrue(getattr(_file.formatTime, "crossbar_per_second", False))
        self.assertEqual(lines(), plain)


# -- touchpoint 8: a body chunk written past server.Request.write and http.Request.write ----


class BodyWriterTouchpointTests(_Private):
    CHUNKS = (b"data: {\"a\":1}\n\n", b"", b"x" * 70000, b"data: [DONE]\n\n")

    def _answer(self, head: bytes, length: bytes | None = None) -> tuple[Any, StringTransport]:
        """A request read from ``head`` on a channel over a StringTransport, its answer's
        head out (as crossbar's write_head leaves it), the transport emptied."""
        channel, transport, resource = _serve(HTTPChannel)
        channel.dataReceived(head)
        request = resource.requests[0]
        request.setHeader(b"content-type", b"text/event-stream")
        if length is not None:
            request.setHeader(b"content-length", length)
        request.write(b"")
        transport.clear()
        return request, transport

    def test_names_exist(self) -> None:
        from twisted.web import http

        for name in ("chunked", "_disconnected", "sentLength", "startedWriting", "finished"):
            if not hasattr(http.Request, name):
                self.fail(moved(f"twisted.web.http.Request.{name}", 8, "no longer a class attribute"))
        for name in ("_encoder", "_inFakeHead"):
            if not hasattr(Request, name):
                self.fail(moved(f"twisted.web.server.Request.{name}", 8, "no longer a class attribute"))
        self.assertEqual(b"".join(http.toChunk(b"abc")), b"3\r\nabc\r\n",
                         moved("twisted.web.http.toChunk", 8, "a chunk is framed otherwise"))

    def test_same_bytes_and_count_as_request_write(self) -> None:
        """Chunked (HTTP/1.1), with a Content-Length, and to an HTTP/1.0 client: the
        writer's bytes and ``sentLength`` are ``request.write``'s."""
        for head, length in ((b"GET /r HTTP/1.1\r\nHost: x\r\n\r\n", None),
                             (b"GET /r HTTP/1.1\r\nHost: x\r\n\r\n", b"70031"),
                             (b"GET /r HTTP/1.0\r\n\r\n", None)):
            theirs, their_bytes = self._answer(head, length)
            ours, our_bytes = self._answer(head, length)
            write = body_writer(ours)
            self.assertIsNot(write, ours.write, "the head is out: the writer is not the fallback")
            for chunk in self.CHUNKS:
                theirs.write(chunk)
                write(chunk)
                self.assertEqual(our_bytes.value(), their_bytes.value(), moved(
                    "twisted.web.http.Request.write", 8, f"it writes {their_bytes.value()[-40:]!r}"))
                self.assertEqual(ours.sentLength, theirs.sentLength)
            self.assertEqual(ours.chunked, length is None and b"1.1" in head)

    def test_gone_client_and_finished_answer(self) -> None:
        request, transport = self._answer(b"GET /r HTTP/1.1\r\nHost: x\r\n\r\n")
        write = body_writer(request)
        request.finish()
        self.assertRaises(RuntimeError, write, b"late")
        request, transport = self._answer(b"GET /r HTTP/1.1\r\nHost: x\r\n\r\n")
        write = body_writer(request)
        request.connectionLost(Failure(ConnectionDone()))
        write(b"dropped")
        self.assertEqual(transport.value(), b"")

    def test_falls_back_to_request_write(self) -> None:
        """Before the head, for a HEAD request, for an encoded answer, and for a request
        class with its own write: ``request.write`` itself."""
        channel, _, resource = _serve(HTTPChannel)
        channel.dataReceived(b"GET /r HTTP/1.1\r\nHost: x\r\n\r\n")
        request = resource.requests[0]
        self.assertEqual(body_writer(request), request.write)  # head not out yet
        head, _ = self._answer(b"HEAD /r HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(body_writer(head), head.write)
        encoded, _ = self._answer(b"GET /r HTTP/1.1\r\nHost: x\r\n\r\n")
        encoded._encoder = object()
        self.assertEqual(body_writer(encoded), encoded.write)
        for code in (204, 304):  # Twisted makes write a no-op once such a head is out
            channel, transport, resource = _serve(HTTPChannel)
            channel.dataReceived(b"GET /r HTTP/1.1\r\nHost: x\r\n\r\n")
            empty = resource.requests[0]
            empty.setResponseCode(code)
            empty.write(b"")
            transport.clear()
            write = body_writer(empty)
            self.assertEqual(write, empty.write)
            write(b"no body")
            self.assertEqual((transport.value(), empty.sentLength), (b"", 0))
        dummy = DummyRequest([b"r"])
        dummy.startedWriting = 1
        self.assertEqual(body_writer(dummy), dummy.write)  # type: ignore[arg-type]


# -- touchpoint 12: HTTPChannel's answering state, for the channel that parses heads itself ------


class AnsweringStateTouchpointTests(_Private):
    """``start_answering``, ``answering`` and ``hold_pipelined`` leave a channel as
    Twisted's own parser does once a request is complete, and Twisted's ``requestDone``
    undoes them and replays the held bytes."""

    def test_names_exist(self) -> None:
        channel: Any = HTTPChannel()
        if getattr(channel, "_handlingRequest", None) is not False:
            self.fail(moved("HTTPChannel._handlingRequest", 12, "not False on a new channel"))
        if getattr(channel, "_dataBuffer", None) != []:
            self.fail(moved("HTTPChannel._dataBuffer", 12, "not an empty list on a new channel"))
        self.require_attribute(HTTPChannel, "_savedTimeOut", 12, kind="attribute")
        self.require_attribute(HTTPChannel, "rawDataReceived", 12)

    def test_same_state_as_twisteds_parser(self) -> None:
        from crossbar.compat.twisted import answering, start_answering

        twisted_channel: Any
        twisted_channel, _, resource = _serve(HTTPChannel)
        saved = twisted_channel.timeOut
        twisted_channel.dataReceived(b"GET /1 HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(len(resource.requests), 1)
        ours: Any
        ours, _, _ = _serve(HTTPChannel)
        self.assertFalse(answering(ours))
        start_answering(ours)
        for channel in (twisted_channel, ours):
            self.assertTrue(answering(channel))
            self.assertEqual((channel._savedTimeOut, channel.timeOut), (saved, None))

    def test_held_bytes_are_replayed_by_request_done(self) -> None:
        from crossbar.compat.twisted import hold_pipelined

        channel: Any
        channel, transport, resource = _serve(HTTPChannel)
        channel.dataReceived(b"GET /1 HTTP/1.1\r\nHost: x\r\n\r\n")  # Twisted's parser: answering
        hold_pipelined(channel, b"GET /2 HTTP/1.1\r\nHost: x\r\n\r\n")
        hold_pipelined(channel, b"y" * 16384)
        self.assertEqual(transport.producerState, "paused")  # over 16 KiB held
        self.assertEqual(len(resource.requests), 1)
        resource.requests[0].finish()
        self.assertEqual([r.uri for r in resource.requests], [b"/1", b"/2"])
        self.assertEqual(transport.producerState, "producing")


# -- touchpoint 9: the epoll reactor's dispatch without log.callWithLogger -----------------


class _Readable:
    """A descriptor on one end of a socket pair: records the legacy log context's
    ``system`` while its ``doRead`` runs, logs through the legacy ``log.msg``, and can be
    made to fail in ``doRead`` and again in ``connectionLost``."""

    def __init__(self, sock: socket.socket, prefix: str, fail: bool = False) -> None:
        self.sock, self.prefix, self.fail = sock, prefix, fail
        self.seen: list[tuple[tuple[str, str], ...]] = []
        self.lost: list[Failure] = []

    def fileno(self) -> int:
        return self.sock.fileno()

    def logPrefix(self) -> str:
        if self.prefix == "buggy":
            raise KeyError("no prefix")
        return self.prefix

    def doRead(self) -> None:
        from twisted.python import context, log

        self.sock.recv(100)
        self.seen.append(tuple(sorted(context.get(log.ILogContext).items())))
        log.msg("inside doRead")
        if self.fail:
            raise ValueError("doRead failed")

    def connectionLost(self, reason: Failure) -> None:
        self.lost.append(reason)
        if self.fail:
            raise RuntimeError("connectionLost failed too")  # escapes _doReadOrWrite


class LeanDispatchTouchpointTests(_Private):
    def _ready(self, reactor: Any, make: Callable[[socket.socket], _Readable]) -> _Readable:
        """A descriptor made by ``make`` on one end of a socket pair, added to
        ``reactor`` as a reader, with a byte waiting for it."""
        a, b = socket.socketpair()
        self.addCleanup(a.close)
        self.addCleanup(b.close)
        reader = make(a)
        reactor.addReader(reader)
        b.send(b"x")
        return reader

    def test_names_exist(self) -> None:
        from twisted.internet import epollreactor
        from twisted.python import context, log

        r = epollreactor.EPollReactor
        self.require_attribute(r, "doPoll", 9)
        self.require_attribute(r, "_doReadOrWrite", 9)
        if r.doIteration is not r.doPoll:
            self.fail(moved("EPollReactor.doIteration", 9, "it is no longer doPoll"))
        source = inspect.getsource(r.doPoll)
        for needed in ("self._poller.poll(timeout, len(self._selectables))", "log.callWithLogger(selectable, _drdw",
                       "if err.errno == errno.EINTR:", "selectable = self._selectables[fd]", "timeout = -1"):
            if needed not in source:
                self.fail(moved("EPollReactor.doPoll", 9, f"it no longer says {needed!r}"))
        if "callWithContext({\"system\": lp}" not in inspect.getsource(log.callWithLogger):
            self.fail(moved("twisted.python.log.callWithLogger", 9, "its context is no longer {'system': logPrefix}"))
        self.require_attribute(context.theContextTracker, "currentContext", 9)
        self.assertIsInstance(context.theContextTracker.currentContext().contexts, list,
                              moved("ContextTracker.contexts", 9, "no longer a list"))

    def _turn(self, lean: bool, readers: list[tuple[str, bool]]) -> tuple[Any, ...]:
        """One turn of a fresh epoll reactor (Twisted's dispatch or the lean one), inside
        an outer log context with a key of its own, with ``readers`` (prefix, failing)
        ready: the log context each saw, the legacy events (message or failure, system),
        how often each was told it was lost and whether it is still a reader, and the
        context stack's depth and log context after the turn."""
        from twisted.internet.epollreactor import EPollReactor
        from twisted.python import context, log

        from crossbar.compat.twisted import lean_dispatch

        r = EPollReactor()
        self.addCleanup(r._poller.close)
        if lean:
            self.assertTrue(lean_dispatch(r))
            self.assertFalse(lean_dispatch(r), "installed once")
        ready = [self._ready(r, lambda sock, p=prefix, f=fail: _Readable(sock, p, f)) for prefix, fail in readers]
        events: list[dict[str, Any]] = []
        log.addObserver(events.append)
        stack = context.theContextTracker.currentContext().contexts
        try:
            depth = len(stack)
            outer = dict(context.get(log.ILogContext), extra="outer key")
            context.call({log.ILogContext: outer}, r.doIteration, 0)
            after = (len(stack) - depth, context.get(log.ILogContext))
        finally:
            log.removeObserver(events.append)
        got = sorted((" ".join(map(str, e.get("message", ()))) or type(e["failure"].value).__name__,
                      e.get("system", "")) for e in events)
        self.flushLoggedErrors(ValueError, RuntimeError, KeyError)
        seen = sorted((tuple(reader.seen), len(reader.lost), reader in r.getReaders()) for reader in ready)
        return seen, got, after

    def test_same_context_logs_and_errors_as_twisted(self) -> None:
        for readers in ([("Reader,7,127.0.0.1", False)], [("Reader,7,127.0.0.1", True)], [("buggy", False)],
                        [("A,1,127.0.0.1", False), ("B,2,127.0.0.1", True), ("buggy", True)]):
            twisted_way = self._turn(False, readers)
            lean = self._turn(True, readers)
            self.assertEqual(lean, twisted_way, f"readers {readers}")
            self.assertEqual(twisted_way[2], (0, {"system": "-"}), "the context stack is back where it was")
            for prefix, fail in readers:  # each saw its own system and the outer context's other keys
                system = "(buggy logPrefix method)" if prefix == "buggy" else prefix
                self.assertIn(((( ("extra", "outer key"), ("system", system)),), int(fail), not fail), twisted_way[0])

    def test_the_loops_thread(self) -> None:
        """Installed on one thread, run on another: the loop's thread's context stack is
        the one pushed to and read from (Twisted's thread-local tracker)."""
        import threading

        from twisted.internet.epollreactor import EPollReactor
        from twisted.python import context, log

        from crossbar.compat.twisted import lean_dispatch

        r = EPollReactor()
        self.addCleanup(r._poller.close)
        self.assertTrue(lean_dispatch(r))
        reader = self._ready(r, lambda sock: _Readable(sock, "Reader,3,127.0.0.1"))
        main_stack = list(context.theContextTracker.currentContext().contexts)
        after: list[Any] = []

        def loop() -> None:
            context.call({log.ILogContext: {"system": "-", "thread": "yes"}}, r.doIteration, 0)
            after.append(len(context.theContextTracker.currentContext().contexts))

        thread = threading.Thread(target=loop)
        thread.start()
        thread.join()
        self.assertEqual(reader.seen, [(("system", "Reader,3,127.0.0.1"), ("thread", "yes"))])
        self.assertEqual(after, [1])
        self.assertEqual(context.theContextTracker.currentContext().contexts, main_stack)

    def test_upstreams_first_then_clients_within_the_budget(self) -> None:
        """Connections crossbar made go first; the others until the turn is
        INCOMING_BUDGET old (at least one per turn); the rest come in the next turn."""
        from twisted.internet.epollreactor import EPollReactor
        from twisted.internet.tcp import Client

        from crossbar.compat.twisted import INCOMING_BUDGET, lean_dispatch

        now = [0.0]
        order: list[str] = []

        class _Client(_Readable):  # a client's connection: each read takes 60% of the budget
            def doRead(self) -> None:
                super().doRead()
                order.append(self.prefix)
                now[0] += 0.6 * INCOMING_BUDGET

        class _Made(_Readable, Client):  # a connection crossbar made (an upstream)
            def doRead(self) -> None:
                super().doRead()
                order.append(self.prefix)

        r = EPollReactor()
        self.addCleanup(r._poller.close)
        self.assertTrue(lean_dispatch(r, clock=lambda: now[0]))
        ready = [_Client, _Made, _Client, _Client, _Made]
        for n, kind in enumerate(ready):
            self._ready(r, lambda sock, k=kind, n=n: k(sock, f"{k.__name__}{n}"))
        r.doIteration(0)
        self.assertEqual(sorted(order[:2]), ["_Made1", "_Made4"], f"upstreams first: {order}")
        self.assertEqual(len(order), 4, f"two clients within the budget, the third waits: {order}")
        r.doIteration(0)
        self.assertEqual(len(order), 5, order)
        self.assertEqual(sorted(order), ["_Client0", "_Client2", "_Client3", "_Made1", "_Made4"])
        class _Slow(_Client):  # a read longer than the whole budget: still one per turn
            def doRead(self) -> None:
                super().doRead()
                now[0] += INCOMING_BUDGET

        class _SlowMade(_Made):  # upstream work that alone takes twice the budget
            def doRead(self) -> None:
                super().doRead()
                now[0] += 2 * INCOMING_BUDGET

        for n, kind in enumerate([_Slow, _SlowMade, _Slow]):
            self._ready(r, lambda sock, k=kind, n=n: k(sock, f"slow{n}"))
        r.doIteration(0)
        self.assertEqual(len(order), 7, f"the upstream, then one client however late the turn is: {order}")
        self.assertEqual(order[5], "slow1")
        r.doIteration(0)
        self.assertEqual(len(order), 8)

    def test_keyboard_interrupt_and_poll_errors(self) -> None:
        """``KeyboardInterrupt`` from a descriptor goes through; ``EINTR`` from
        ``epoll_wait`` ends the turn quietly, another error is raised."""
        from twisted.internet.epollreactor import EPollReactor

        from crossbar.compat.twisted import lean_dispatch

        class _Interrupting(_Readable):
            def logPrefix(self) -> str:
                raise KeyboardInterrupt()

        class _LostInterrupting(_Readable):
            def connectionLost(self, reason: Failure) -> None:
                raise KeyboardInterrupt()

        class _Poller:
            def __init__(self, errno_: int) -> None:
                self.errno = errno_

            def poll(self, timeout: float, most: int) -> list[tuple[int, int]]:
                raise OSError(self.errno, "poll failed")

        import errno

        for lean in (False, True):
            r = EPollReactor()
            self.addCleanup(r._poller.close)
            if lean:
                lean_dispatch(r)
            interrupting = self._ready(r, lambda sock: _Interrupting(sock, "x"))
            self.assertRaises(KeyboardInterrupt, r.doIteration, 0)
            r.removeAll()
            r.addReader(_LostInterrupting(interrupting.sock, "x", fail=True))  # type: ignore[arg-type]
            self.assertRaises(KeyboardInterrupt, r.doIteration, 0)  # from connectionLost, past _doReadOrWrite
            self.flushLoggedErrors(ValueError)
            for code, raised in ((errno.EINTR, False), (errno.EBADF, True)):
                r = EPollReactor()
                self.addCleanup(r._poller.close)
                real, r._poller = r._poller, _Poller(code)
                self.addCleanup(real.close)
                if lean:
                    lean_dispatch(r)
                if raised:
                    self.assertRaises(OSError, r.doIteration, 0)
                else:
                    self.assertIsNone(r.doIteration(0))

    def test_only_an_epoll_reactor(self) -> None:
        from crossbar.compat.twisted import lean_dispatch

        self.assertFalse(lean_dispatch(MemoryReactor()))
        self.assertFalse(lean_dispatch(Clock()))


class TextLogFileTouchpointTests(SynchronousTestCase):
    """Touchpoint 11: the file twistd's text log observer writes to, found among the
    log publisher's observers (``LogPublisher._observers``, ``FileLogObserver._outFile``)."""

    def test_twistds_logfile_and_standard_output(self) -> None:
        import sys

        from twisted.logger import LogPublisher
        from twisted.python.logfile import LogFile
        from twisted.scripts._twistd_unix import UnixAppLogger, ServerOptions

        from crossbar.compat.twisted import text_log_file

        path = os.path.abspath(self.mktemp())
        options = ServerOptions()
        options.parseOptions(["-n", f"--logfile={path}", "--pidfile="])
        observer = UnixAppLogger(options)._getLogObserver()
        out = text_log_file(LogPublisher(observer, lambda e: None))
        self.assertIsInstance(out, LogFile)
        self.addCleanup(out.close)
        self.assertEqual(out.path, path)
        options = ServerOptions()
        options.parseOptions(["-n", "--pidfile="])
        self.assertIs(text_log_file(LogPublisher(UnixAppLogger(options)._getLogObserver())), sys.stdout)

    def test_none_or_several(self) -> None:
        from twisted.logger import LogPublisher, jsonFileLogObserver, textFileLogObserver

        from crossbar.compat.twisted import text_log_file

        self.assertIsNone(text_log_file(LogPublisher(lambda e: None)))
        one, two = io.StringIO(), io.StringIO()
        self.assertIs(text_log_file(LogPublisher(textFileLogObserver(one))), one)
        self.assertIsNone(text_log_file(LogPublisher(textFileLogObserver(one), jsonFileLogObserver(two))))
