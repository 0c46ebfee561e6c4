"""One crossbar instance's connections to Redis (docs/design.md §Several crossbars).

A :class:`RedisLink` holds the command connection (txredisapi, through
:mod:`crossbar.compat.txredis`: hiredis-packed, quiet, TCP_NODELAY) and the subscriber,
and runs commands with a bound on each reply: one watchdog timer for every command in
flight rather than a timer each. What the commands mean is the cluster's
(:class:`~crossbar.state.cluster.RedisCluster`).
"""

from __future__ import annotations

import hashlib
from collections import deque
from typing import Any, Callable

import txredisapi
from twisted.internet.defer import CancelledError, Deferred, DeferredList, TimeoutError, fail
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.python.failure import Failure

from crossbar.compat import txredis
from crossbar.config import HostTLSSettings, RedisURL
from crossbar.upstream.tls import client_creator

__all__ = ["RedisLink"]

_SHAS: dict[str, str] = {}
"""script text -> its SHA1 (EVALSHA), computed once per script."""

class RedisLink:
    """The connections of one instance to the Redis at ``url``.

    :param reactor: the reactor (connections, the watchdog).
    :param tls: ``cluster.tls`` for a ``rediss://`` URL, or None: the system trust store.
    :ivar factory: the command connection's txredisapi factory once :meth:`connect` ran.
    :ivar subscriber: the subscriber's factory once :meth:`connect` ran.
    """

    def __init__(self, url: RedisURL, reactor: Any, tls: HostTLSSettings | None = None) -> None:
        self.url = url
        self.reactor = reactor
        self.tls = tls
        self.factory: Any = None
        self.subscriber: Any = None
        self._waiting: deque[tuple[float, Deferred[Any]]] = deque()
        """commands in flight: (when their bound passes, the reply's Deferred), in order sent"""
        self._watchdog: Any = None
        self._connect_timeout = 1.0

    def connect(self, subscriber: Any, on_lost: Callable[[Failure], None],
                on_first_failure: Callable[[Failure], None], connect_timeout: float = 1.0) -> None:
        """Open (in the background, reconnecting) the command connection and
        ``subscriber`` (a txredisapi ``SubscriberFactory``), each within
        ``connect_timeout`` seconds; ``on_lost`` is told why each command connection
        ended, ``on_first_failure`` when its first attempt failed."""
        self._connect_timeout = connect_timeout
        url = self.url
        factory = txredisapi.RedisFactory(
            f"{url.host}:{url.port}", url.db, 1, isLazy=True, charset="utf-8", password=url.password,
            replyTimeout=None, convertNumbers=False, username=url.username,
        )
        factory.protocol = txredis.Protocol
        factory.maxDelay = 1.0  # rejoin within about a second of Redis answering again
        factory.initialDelay = 0.1
        txredis.connect(factory, self._endpoint(), on_lost, on_first_failure=on_first_failure)
        self.factory = factory
        subscriber.password = url.password
        subscriber.username = url.username
        subscriber.maxDelay = 1.0
        subscriber.initialDelay = 0.1
        txredis.connect(subscriber, self._endpoint())
        self.subscriber = subscriber

    def _endpoint(self) -> Any:
        url = self.url
        endpoint: Any = HostnameEndpoint(self.reactor, url.host, url.port, timeout=self._connect_timeout)
        if url.tls:
            endpoint = wrapClientTLS(client_creator(url.host, self.tls), endpoint)
        return endpoint

    def disconnect(self) -> Deferred[Any]:
        """Close both connections; fires once they are closed (the watchdog stays until
        then: it bounds a last write), every reply still awaited having failed."""

        def unwatch(result: object) -> object:
            if self._watchdog is not None and self._watchdog.active():
                self._watchdog.cancel()
            self._watchdog = None
            self._waiting.clear()
            return result

        ds = [f.disconnect() for f in (self.factory, self.subscriber) if f is not None]
        return DeferredList(ds, consumeErrors=True).addBoth(unwatch)

    def command(self, name: str, *args: Any, bound: float) -> Deferred[Any]:
        """Run one command with ``bound`` seconds on its reply
        (errback: :class:`~twisted.internet.defer.TimeoutError`); errbacks with
        ConnectionError at once when no connection is up (nothing queues up). A failure
        here is the caller's to handle: only the cluster's own reads and writes turn the
        instance alone. ``eval`` sends EVALSHA with the script's hash (computed once),
        and the script itself only when Redis does not know it yet."""
        factory = self.factory
        connection = factory.pool[0] if factory is not None and factory.pool else None
        if connection is None or not connection.connected:
            return fail(txredisapi.ConnectionError("not connected"))
        # The pool's one connection itself: txredisapi's pool handler adds a generator
        # and a queue per command, for nothing with one connection.
        d: Deferred[Any]
        if name == "eval":
            script, keys, argv = args
            sha = _SHAS.get(script)
            if sha is None:
                sha = _SHAS[script] = hashlib.sha1(script.encode()).hexdigest()
            d = connection.execute_command("EVALSHA", sha, len(keys), *keys, *argv)
            d.addErrback(self._command_failed, connection, script, keys, argv, bound)
        else:
            d = getattr(connection, name)(*args)
            d.addErrback(self._command_failed, None, None, (), (), bound)
        # One watchdog for every command in flight rather than a timer each (what a
        # timer per command cost: docs in bench/HISTORY.md, "Several crossbars").
        deadline = self.reactor.seconds() + bound
        self._waiting.append((deadline, d))
        if self._watchdog is None or self._watchdog.getTime() > deadline:
            self._arm(deadline)
        return d

    def _command_failed(self, failure: Failure, connection: Any, script: str | None, keys: Any, argv: Any,
                        bound: float) -> Any:
        if failure.check(CancelledError):
            raise TimeoutError(f"no reply from Redis within {int(bound * 1000)} ms")
        if script is not None and failure.check(txredisapi.ResponseError) and \
                str(failure.value).startswith("NOSCRIPT"):
            # Redis restarted or its scripts were flushed: send the script itself (rare).
            return connection.eval(script, keys, argv).addTimeout(bound, self.reactor)
        return failure

    def _watch(self) -> None:
        """Fail every command whose bound has passed without a reply (the watchdog)."""
        self._watchdog = None
        now = self.reactor.seconds()
        pending, self._waiting = self._waiting, deque()
        expired = []
        for deadline, d in pending:  # (replies come in order, but bounds may differ)
            if not d.called:
                if deadline <= now + 1e-6:  # (a timer's float time may fall a hair short)
                    expired.append(d)
                else:
                    self._waiting.append((deadline, d))
        for d in expired:
            d.cancel()  # errback: TimeoutError (_command_failed)
        if self._waiting:
            self._arm(min(deadline for deadline, _ in self._waiting))

    def _arm(self, when: float) -> None:
        """The watchdog runs at ``when`` at the latest."""
        watchdog = self._watchdog
        if watchdog is not None:
            if watchdog.getTime() <= when:
                return
            watchdog.cancel()
        self._watchdog = self.reactor.callLater(max(0.0, when - self.reactor.seconds()), self._watch)
