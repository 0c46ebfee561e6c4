"""Bounds on client connections and descriptors (issue 20 item 4; docs/design.md §The
proxy, rule 9): beyond a bound a connection is refused at once (503, closed) and the
others go on being served; the listen backlog is not Twisted's 50; accept errors
(EMFILE) are logged at most once a minute. Loopback crossbar and raw sockets; the log
limiter on a :class:`~twisted.internet.task.Clock`."""

from __future__ import annotations

import json
import resource
import socket

from twisted.internet import reactor
from twisted.internet.task import Clock
from twisted.logger import LogEvent, Logger
from twisted.trial.unittest import SynchronousTestCase, TestCase

from crossbar.config import parse_config
from crossbar.process.listen import listen_endpoint
from crossbar.proxy.connections import (
    LISTEN_BACKLOG, RESERVED_FDS, RateLimitedAcceptErrors, connection_limit, with_backlog,
)
from crossbar.compat.twisted import wrap_port_logger
from tests.harness import FakeLlama, listen, port_of, start_crossbar, wait_for
from tests.raw import parse_responses, raw_exchange, request_bytes


class BoundTests(SynchronousTestCase):
    def test_derived_from_the_descriptor_limit(self) -> None:
        self.assertEqual(connection_limit(1024), (1024 - RESERVED_FDS) // 2)
        self.assertEqual(connection_limit(65536), (65536 - RESERVED_FDS) // 2)
        self.assertEqual(connection_limit(20), 16)
        self.assertEqual(connection_limit(resource.RLIM_INFINITY), ((1 << 20) - RESERVED_FDS) // 2)
        # Two descriptors per connection (client, upstream) and the reserve fit the limit.
        self.assertLessEqual(2 * connection_limit(1024) + RESERVED_FDS, 1024)
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.assertEqual(connection_limit(), connection_limit(soft))

    def test_backlog_is_not_fifty(self) -> None:
        """Item 4: Twisted's default listen backlog is 50."""
        self.assertEqual(with_backlog("tcp:7777:interface=127.0.0.1"), "tcp:7777:interface=127.0.0.1:backlog=1024")
        self.assertEqual(with_backlog("ssl:443:privateKey=k.pem"), "ssl:443:privateKey=k.pem:backlog=1024")
        self.assertEqual(with_backlog("unix:/run/x.sock"), "unix:/run/x.sock:backlog=1024")
        self.assertEqual(with_backlog("tcp:7777:backlog=64"), "tcp:7777:backlog=64")  # the operator's own
        self.assertEqual(with_backlog("systemd:domain=INET:index=0"), "systemd:domain=INET:index=0")
        config = parse_config('listen: "tcp:0:interface=127.0.0.1"\nhosts: {a: "http://h:1"}\nroutes: {r: {hosts: [a]}}\n')
        endpoint = listen_endpoint(reactor, config)
        self.assertEqual(getattr(endpoint, "_backlog"), LISTEN_BACKLOG)
        # The workers' SO_REUSEPORT sockets are opened from the same parse.
        from crossbar.process.listen import tcp_address

        address = tcp_address(config)
        assert address is not None
        self.assertEqual(address.backlog, LISTEN_BACKLOG)


class AcceptErrorLogTests(SynchronousTestCase):
    def test_at_most_one_line_a_minute(self) -> None:
        """Item 4: Twisted logged one ``EMFILE`` line per refused connection (350 KB of
        log in 45 s). Through a real listening port's logger: one line a minute."""
        seen: list[LogEvent] = []
        clock = Clock()
        port = reactor.listenTCP(0, _NoFactory(), interface="127.0.0.1")  # type: ignore[attr-defined]
        self.addCleanup(port.stopListening)
        self.assertTrue(wrap_port_logger(port, lambda observer: RateLimitedAcceptErrors(seen.append, clock)))
        logger: Logger = getattr(port, "_logger")
        for _ in range(1000):
            logger.info("Could not accept new connection ({acceptError})", acceptError="EMFILE")
            logger.info("EMFILE encountered; releasing reserved file descriptor.")
            clock.advance(0.01)
        logger.info("something else")
        self.assertEqual(len(seen), 2)
        self.assertEqual(seen[0]["count"], 1)
        self.assertEqual(seen[1]["log_format"], "something else")
        clock.advance(60)
        logger.info("Could not accept new connection ({acceptError})", acceptError="EMFILE")
        self.assertEqual(len(seen), 3)
        self.assertEqual(seen[2]["count"], 2000)  # every one since the last line is counted


class _NoFactory:
    def doStart(self) -> None:
        pass

    def doStop(self) -> None:
        pass

    def buildProtocol(self, addr: object) -> None:
        return None


class ConnectionBoundTests(TestCase):
    async def test_connections_over_the_bound_are_refused_at_once(self) -> None:
        """Item 4: 1,100 silent connections under a 1024 descriptor limit made every
        new client fail for as long as they stayed. Over the bound (4 here) a
        connection gets 503 with ``Retry-After`` at once; once one leaves, the next
        client is served."""
        host = FakeLlama(["m"])
        url = await listen(self, host)
        service, base = await start_crossbar(self, f"""
health: {{interval: 60, timeout: 5}}
hosts: {{a: {url}}}
routes: {{r: {{hosts: [a], default_model: m}}}}
""")
        await service.poller.when_first_round_done()
        service.site.max_connections = 4
        port = port_of(base)
        silent = []
        for _ in range(4):
            s = socket.create_connection(("127.0.0.1", port))
            self.addCleanup(s.close)
            silent.append(s)
        await wait_for(lambda: len(service.site.open_channels) == 4, what="4 open connections")
        data, how = await raw_exchange(port, request_bytes(b"GET", b"/r/v1/models"), timeout=5)
        [answer] = parse_responses(data)
        self.assertEqual((answer.status, json.loads(answer.body)), (503, {"error": {"code": 503, "message": "too many connections", "type": "unavailable_error"}}))
        self.assertEqual(answer.one(b"retry-after"), b"1")
        self.assertIn(how, ("close", "half-close"))  # closed at once, the request unread
        self.assertEqual(len(service.site.open_channels), 4)
        silent.pop().close()
        await wait_for(lambda: len(service.site.open_channels) == 3, what="one connection gone")
        data, _ = await raw_exchange(port, request_bytes(b"GET", b"/r/v1/models"), timeout=5)
        self.assertEqual(parse_responses(data)[0].status, 200)
