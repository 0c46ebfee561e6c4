"""The health poller: polls every host and records the result (docs/design.md §The health table).

One poll of one host is ``GET <base>/health`` (must be 200), then ``GET <base>/v1/models``
(must be 200 and list models); see :class:`HTTPProbe`. Both URLs are built by
:meth:`crossbar.hosturl.HostURL.target`, exactly as the proxy builds a request's. :class:`HealthPoller` runs a
``LoopingCall`` that every ``health.interval`` starts a poll of each host that has none
in flight (rule 7), bounds each by ``health.timeout``, and records every result in the
:class:`~crossbar.hosts.health.HealthTable` as it arrives. It never requests ``/slots`` nor
anything else that would make a host load a model (rule 9).

For a host with ``max_inflight: slots`` it also reads ``GET <base>/props`` →
``total_slots`` (docs/design.md §Choosing a host, rule 2): after the host's first good poll
and after each recovery (and after a good poll while the number is still unknown),
never for a host in router mode (its ``/v1/models`` entries carry a ``status``). That
read is not part of the poll: it fails nothing, and until it succeeds the host has no
limit.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterable, Mapping, cast

from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred, DeferredList, ensureDeferred, fail
from twisted.internet.interfaces import IPushProducer, IReactorTime
from twisted.internet.protocol import Protocol, connectionDone
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.iweb import UNKNOWN_LENGTH, IAgent, IResponse
from zope.interface import Interface, implementer

from twisted.web.http_headers import Headers

from crossbar.upstream.failures import describe_failure
from crossbar.hosts.health import HealthTable
from crossbar.config import Config
from crossbar.hosturl import HostURL, host_url
from crossbar.hosts.models import ModelList, ModelsError, parse_models
from crossbar.waiting import Condition

__all__ = ["MAX_POLL_BODY", "BodyTooLarge", "HTTPProbe", "HealthPoller", "IHostProbe", "PollCancelled", "PollFailed", "parse_slots"]

MAX_POLL_BODY = 1 << 20
"""Bytes read at most from a ``/health`` or ``/v1/models`` body (docs/design.md §health, rule 2)."""


class PollFailed(Exception):
    """A poll found the host unfit; ``reason`` starts ``health: `` or ``models: ``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class PollCancelled(CancelledError):
    """A poll was cancelled while in ``phase`` (``"health"`` or ``"models"``)."""

    def __init__(self, phase: str) -> None:
        super().__init__(phase)
        self.phase = phase


class IHostProbe(Interface):
    """Polls one host once."""

    def poll(url: str | HostURL) -> Deferred[ModelList | tuple[str, ...]]:
        """Poll the host whose configured base URL is ``url`` (a ``str``; a
        :class:`~crossbar.hosturl.HostURL` is accepted too).

        Fires with the :class:`~crossbar.hosts.models.ModelList` the host listed (or, from a
        fake, the loaded ids); errbacks with :class:`PollFailed` for
        a host that failed the poll, or :class:`PollCancelled` when cancelled.
        """

    def slots(url: str | HostURL) -> Deferred[int]:
        """The number of slots the single-model llama-server at ``url`` reports
        (``GET <base>/props`` → ``total_slots``); errbacks with :class:`PollFailed`
        (``props: ...``) when it cannot be read."""


class BodyTooLarge(Exception):
    """An answer went over the ``limit`` bytes :func:`read_capped` reads (its message
    says so: ``answer over N bytes``)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"answer over {limit} bytes")
        self.limit = limit


class _CappedBody(Protocol):
    """Collects a response body of at most ``limit`` bytes.

    Past the limit it stops the transport (the connection is closed and nothing more is
    read) and fails ``finished`` with :class:`BodyTooLarge`. Cancelling ``finished``
    closes the connection too, so a host dripping a body slowly keeps no socket open
    after the poll's timeout.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._size = 0
        self._chunks: list[bytes] = []
        self.finished: Deferred[bytes] = Deferred(self._cancel)
        self._done = False

    def _stop(self) -> None:
        self._done = True
        self._chunks = []
        if self.transport is not None:  # a TransportProxyProducer: the connection
            cast(IPushProducer, self.transport).stopProducing()

    def _cancel(self, d: Deferred[bytes]) -> None:
        self._stop()  # the Deferred then fails with CancelledError

    def dataReceived(self, data: bytes) -> None:
        if self._done:
            return
        self._size += len(data)
        if self._size > self._limit:
            self._stop()
            self.finished.errback(BodyTooLarge(self._limit))
            return
        self._chunks.append(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self._done:
            return
        self._done = True
        if reason.check(ResponseDone, PotentialDataLoss):
            self.finished.callback(b"".join(self._chunks))
        else:
            self.finished.errback(reason)
        self._chunks = []


class _Discard(Protocol):
    """Closes the connection of a body crossbar does not want to read."""

    def makeConnection(self, transport: Any) -> None:
        super().makeConnection(transport)
        cast(IPushProducer, transport).stopProducing()


def read_capped(response: IResponse, limit: int) -> Deferred[bytes]:
    """The body of ``response``, if it has at most ``limit`` bytes.

    A ``Content-Length`` over the limit fails at once without reading; a longer body is
    cut off at the limit. Either way the connection is closed.

    :raises BodyTooLarge: (as a failure) when the body exceeds ``limit`` bytes.
    """
    if response.length is not UNKNOWN_LENGTH and response.length > limit:
        response.deliverBody(_Discard())
        return fail(BodyTooLarge(limit))
    body = _CappedBody(limit)
    response.deliverBody(body)
    return body.finished


def _cancelled(failure: Failure) -> bool:
    """Whether ``failure`` is, or wraps (``ResponseNeverReceived`` etc.), a cancellation."""
    if failure.check(CancelledError):
        return True
    return any(isinstance(r, Failure) and _cancelled(r) for r in getattr(failure.value, "reasons", None) or ())


@implementer(IHostProbe)
class HTTPProbe:
    """The real probe: two bounded GETs on ``agent`` (docs/design.md §health, rule 2).

    The URLs are :meth:`HostURL.target` bytes handed to ``agent.request`` as they are:
    not through treq, whose URL handling (hyperlink) refuses IPv6 literals and
    re-encodes some path characters, so a poll would not reach what a request reaches.
    A URL crossbar cannot parse fails the poll (``health: ...``).

    :param agent: the agent polls go through.
    :param api_keys: host base URL -> the host's ``api_key``, sent as
        ``Authorization: Bearer`` on both requests (docs/design.md §Access).

    Redirects are not followed (a 3xx is not 200). Bodies are read only up to
    :data:`MAX_POLL_BODY` bytes: a longer one fails the poll and its connection is
    closed without reading the rest. Cancelling a poll closes its connection at once.
    """

    def __init__(self, agent: IAgent, api_keys: Mapping[str, str] | None = None) -> None:
        self._agent = agent
        self._api_keys = dict(api_keys or {})

    def poll(self, url: str | HostURL) -> Deferred[ModelList | tuple[str, ...]]:
        """``GET /health`` then ``GET /v1/models`` of ``url``; see :class:`IHostProbe`."""
        return ensureDeferred(self._poll(url))

    def slots(self, url: str | HostURL) -> Deferred[int]:
        """``GET /props`` of ``url`` → ``total_slots``; see :class:`IHostProbe`."""
        return ensureDeferred(self._slots(url))

    def _target(self, url: str | HostURL, path: bytes, phase: str) -> tuple[bytes, Headers]:
        """The URL of ``path`` on the host and the headers a poll sends it."""
        try:
            parsed = url if isinstance(url, HostURL) else host_url(url)
        except ValueError as e:
            raise PollFailed(f"{phase}: bad host URL: {e}") from None
        headers = Headers()
        api_key = self._api_keys.get(parsed.url)
        if api_key is not None:  # docs/design.md §Access: the host's key on polls too
            headers.setRawHeaders(b"Authorization", [b"Bearer " + api_key.encode("ascii")])
        return parsed.target(path), headers

    async def _slots(self, url: str | HostURL) -> int:
        target, headers = self._target(url, b"/props", "props")
        try:
            return parse_slots(await self._get("props", target, headers))
        except ValueError as e:
            raise PollFailed(f"props: {e}") from None

    async def _get(self, phase: str, url: bytes, headers: Headers) -> bytes:
        try:
            response: IResponse = await self._agent.request(b"GET", url, headers, None)
        except Exception:
            failure = Failure()
            if _cancelled(failure):
                raise PollCancelled(phase) from None
            raise PollFailed(f"{phase}: {describe_failure(failure)}") from None
        problem: str | None = None
        body = b""
        try:
            body = await read_capped(response, MAX_POLL_BODY)
        except BodyTooLarge:
            problem = f"{phase}: body larger than {MAX_POLL_BODY} bytes"
        except Exception:
            failure = Failure()
            if _cancelled(failure):
                raise PollCancelled(phase) from None
            problem = f"{phase}: {describe_failure(failure)}"
        if response.code != 200:  # the status says more than the body (read only to drain it)
            raise PollFailed(f"{phase}: HTTP {response.code}")
        if problem is not None:
            raise PollFailed(problem)
        return body

    async def _poll(self, url: str | HostURL) -> ModelList:
        health, headers = self._target(url, b"/health", "health")
        await self._get("health", health, headers)
        models, _ = self._target(url, b"/v1/models", "models")
        body = await self._get("models", models, headers)
        try:
            return parse_models(body)
        except ModelsError as e:
            raise PollFailed(f"models: {e}") from None


def parse_slots(body: bytes) -> int:
    """``total_slots`` of a llama-server ``/props`` answer (a whole number >= 1).

    :raises ValueError: naming what is wrong (``bad JSON``, ``no total_slots``, ...).
    """
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        raise ValueError("bad JSON") from None
    slots = doc.get("total_slots") if isinstance(doc, dict) else None
    if slots is None:
        raise ValueError("no total_slots")
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"total_slots is not a whole number >= 1: {str(slots)[:40]!r}")
    return slots


class HealthPoller(Service):
    """Polls ``hosts`` every ``interval`` seconds into ``table``.

    :param table: where results are recorded.
    :param hosts: host name -> base URL.
    :param probe: polls one host (:class:`HTTPProbe`, or a fake in unit tests).
    :param interval: seconds between poll rounds (``health.interval``).
    :param timeout: seconds one poll of one host may take (``health.timeout``).
    :param clock: the reactor (or a ``Clock`` in tests).
    :param on_poll: called with (host name, seconds taken, ok) after every recorded poll.
    :param wants_slots: host name -> whether it has ``max_inflight: slots`` (read at
        each decision, so a reload's change counts); default: none has.
    """

    _log = Logger(namespace="crossbar.poller")

    def __init__(
        self,
        table: HealthTable,
        hosts: Mapping[str, str | HostURL],
        probe: IHostProbe,
        interval: float,
        timeout: float,
        clock: IReactorTime,
        on_poll: Callable[[str, float, bool], None] | None = None,
        wants_slots: Callable[[str], bool] | None = None,
    ) -> None:
        self.table = table
        self.hosts = dict(hosts)
        self.probe = probe
        self.interval = interval
        self.timeout = timeout
        self.clock = clock
        self._on_poll = on_poll
        self._wants_slots = wants_slots
        self._inflight: dict[str, Deferred[Any]] = {}
        self._slot_reads: dict[str, Deferred[int]] = {}
        self._slots_problem: dict[str, str] = {}
        self._loop: LoopingCall | None = None
        self._stopping = False
        self._first_round = Condition(lambda: self.first_round_done)

    def startService(self) -> None:
        super().startService()
        self._stopping = False
        loop = LoopingCall(self.poll_round)
        loop.clock = self.clock
        self._loop = loop
        loop.start(self.interval, now=True)

    def stopService(self) -> Deferred[Any]:
        super().stopService()
        self._stopping = True
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None
        pending = list(self._inflight.values())
        reads, self._slot_reads = list(self._slot_reads.values()), {}
        for d in pending + reads:
            d.cancel()
        return DeferredList(pending, consumeErrors=True)

    @property
    def first_round_done(self) -> bool:
        """Every host's first poll has finished (or timed out)."""
        return all(s.polled for s in self.table.all().values())

    def when_first_round_done(self) -> Deferred[None]:
        """A Deferred that fires once :attr:`first_round_done` is true."""
        return self._first_round.wait()

    def set_hosts(self, hosts: Mapping[str, str | HostURL], fresh: Iterable[str] = ()) -> None:
        """Poll ``hosts`` (name -> base URL) from now on (a config reload).

        A poll in flight to a host that is gone, whose URL changed or that is in
        ``fresh`` (its connection settings changed: ``tls``, ``api_key``) is cancelled
        (it records nothing, rule 6); while running, the new hosts, those whose URL
        changed and the ``fresh`` ones are polled at once (the others keep their
        schedule): readiness and waiting requests wait for their first poll.
        """
        old, self.hosts = self.hosts, dict(hosts)
        restart = {name for name in self.hosts if old.get(name) != self.hosts[name]} | set(fresh)
        for name, d in list(self._inflight.items()):
            if name not in self.hosts or name in restart:
                del self._inflight[name]
                d.cancel()
        for name, read in list(self._slot_reads.items()):
            if name not in self.hosts or name in restart:
                del self._slot_reads[name]
                read.cancel()
        if self.running:
            for name, url in self.hosts.items():
                if name in restart and name not in self._inflight:
                    self._start(name, url)
        self._first_round.check()

    def reconfigure(self, config: Config, probe: IHostProbe, fresh: Iterable[str] = ()) -> None:
        """A reload (docs/design.md §Operations): polls go through ``probe`` (built from
        ``config`` beforehand), every ``health.interval`` with ``health.timeout``, to
        ``config``'s hosts (:meth:`set_hosts`)."""
        self.probe = probe
        self.set_timing(config.health.interval, config.health.timeout)
        self.set_hosts({name: h.url for name, h in config.hosts.items()}, fresh=fresh)

    def set_timing(self, interval: float, timeout: float) -> None:
        """Use ``interval`` seconds between rounds (from the next round on) and
        ``timeout`` seconds per poll (for polls started from now on)."""
        self.interval = interval
        self.timeout = timeout
        if self._loop is not None:
            self._loop.interval = interval

    def poll_round(self) -> None:
        """Start a poll of every host that has none in flight (rule 7).

        Never raises: an exception escaping into the ``LoopingCall`` would stop polling
        for good, so a failure to start one host's poll is logged and the rest go on.
        """
        for name, url in list(self.hosts.items()):
            if name in self._inflight:
                continue
            try:
                self._start(name, url)
            except Exception:
                self._log.failure("starting a poll of {host} failed", host=name)

    def _start(self, name: str, url: str | HostURL) -> None:
        started = self.clock.seconds()
        try:
            d = self.probe.poll(url)
        except Exception:
            d = fail(Failure())
        self._inflight[name] = d
        d.addTimeout(self.timeout, self.clock, onTimeoutCancel=self._timed_out)

        def done(result: object) -> None:
            if self._inflight.get(name) is d:
                del self._inflight[name]
            try:
                self._record(name, result, self.clock.seconds() - started)
            except Exception:
                self._log.failure("recording a poll of {host} failed", host=name)

        d.addBoth(done)  # may run at once if the probe answered synchronously

    @staticmethod
    def _timed_out(result: object, timeout: float) -> Failure:
        """A poll over ``health.timeout`` fails, naming the phase it was in (rule 7)."""
        value = result.value if isinstance(result, Failure) else None
        phase = value.phase if isinstance(value, PollCancelled) else "health"
        return Failure(PollFailed(f"{phase}: timed out after {timeout:g}s"))

    def _record(self, name: str, result: object, took: float) -> None:
        if self._stopping:
            return  # cancelled because crossbar is stopping: says nothing (rule 6)
        if isinstance(result, Failure):
            if result.check(CancelledError):
                return  # cancelled by someone else than the timeout: no verdict on the host
            if isinstance(result.value, PollFailed):
                reason = result.value.reason
            else:
                reason = f"health: {describe_failure(result)}"
            self.table.record_failure(name, reason)
            ok = False
        else:
            before = self.table.get(name)
            self.table.record_success(name, result)  # type: ignore[arg-type]
            ok = True
            self._read_slots_if_due(name, before is not None and before.healthy)
        if self._on_poll is not None:
            self._on_poll(name, took, ok)
        self._first_round.check()

    def _read_slots_if_due(self, name: str, was_healthy: bool) -> None:
        """After a good poll of ``name``: read its slots if it has ``max_inflight:
        slots``, is healthy, is not in router mode, and either just became healthy
        (its first good poll, a recovery) or its slots are still unknown."""
        if self._wants_slots is None or name in self._slot_reads or not self._wants_slots(name):
            return
        status = self.table.get(name)
        url = self.hosts.get(name)
        if status is None or url is None or not status.healthy or status.router:
            return
        if was_healthy and status.slots is not None:
            return
        try:
            d = self.probe.slots(url)
        except Exception:
            d = fail(Failure())
        self._slot_reads[name] = d
        d.addTimeout(self.timeout, self.clock)

        def done(result: int | Failure) -> None:
            if self._slot_reads.get(name) is not d:
                return  # cancelled: the host changed or crossbar is stopping
            del self._slot_reads[name]
            if isinstance(result, Failure):
                reason = result.value.reason if isinstance(result.value, PollFailed) else (
                    f"props: {describe_failure(result)}")
                if self._slots_problem.get(name) != reason:
                    self._slots_problem[name] = reason
                    self._log.warn("host {host}: max_inflight: slots not read ({reason}); no limit until it is",
                                   host=name, reason=reason)
                return
            self._slots_problem.pop(name, None)
            self.table.record_slots(name, result)

        d.addBoth(done)
