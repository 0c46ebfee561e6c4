"""``cluster.redis: rediss://...`` against a real redis-server speaking TLS
(docs/design.md §Several crossbars): counts shared over TLS with the CA of ``cluster.tls``,
and a server certificate crossbar does not trust fails closed (one log line, each
instance counts alone, nothing written to that Redis).

Certificates from ``trustme``; Debian's ``redis-server`` (built with TLS) started per
test with ``--tls-port`` (:mod:`tests.redis_server`; skipped without one, failed under
``CI=true``). crossbar is given only the TLS port; the tests' own checks use the plain one.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import trustme
from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.task import deferLater
from twisted.logger import formatEvent
from twisted.trial.unittest import TestCase

from crossbar.config import ConfigError, parse_config
from crossbar.process.service import CrossbarService
from crossbar.state import cluster as cluster_module
from crossbar.state.cluster import _CONNECTING

from tests.harness import FakeLlama, http_client, listen, start_crossbar, wait_for
from tests.logs import LogCapture
from tests.redis_server import RedisServer, start_redis
from tests.test_cluster import Held


def pem_files(case: TestCase) -> tuple[str, str, str, str]:
    """(server certificate chain, its key, the CA that issued it, another CA) as PEM
    files in a temporary directory; the server certificate names 127.0.0.1."""
    directory = tempfile.mkdtemp(prefix="crossbar-redis-tls-")
    case.addCleanup(lambda: [os.remove(os.path.join(directory, f)) for f in os.listdir(directory)])
    ca, other = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    paths = [os.path.join(directory, name) for name in ("server.pem", "server.key", "ca.pem", "other-ca.pem")]
    server.private_key_and_cert_chain_pem.write_to_path(paths[0])
    server.private_key_pem.write_to_path(paths[1])
    ca.cert_pem.write_to_path(paths[2])
    other.cert_pem.write_to_path(paths[3])
    return paths[0], paths[1], paths[2], paths[3]


def config(host_url: str, redis: RedisServer, ca: str) -> str:
    return (
        f"cluster:\n  redis: rediss://127.0.0.1:{redis.tls_port}/0\n  tls:\n    ca: {ca}\n"
        "health: {interval: 60, timeout: 5}\n"
        f"hosts:\n  h:\n    url: {host_url}\n    max_inflight: 2\n"
        "routes:\n  r:\n    hosts: [h]\n    queue: {max: 50, timeout: 30}\n"
    )


class ConfigTests(TestCase):
    """``cluster.tls``: the keys of a host's ``tls``, only with ``rediss://``."""

    def parse(self, cluster: str) -> Any:
        text = f"listen: tcp:0\ncluster:\n{cluster}hosts:\n  h: http://127.0.0.1:1\nroutes:\n  r:\n    hosts: [h]\n"
        return parse_config(text, "/etc/c.yaml", {})

    def test_ca(self) -> None:
        _, _, ca, _ = pem_files(self)
        settings = self.parse(f"  redis: rediss://cache.example:6380/0\n  tls:\n    ca: {ca}\n").cluster
        self.assertTrue(settings.redis.tls)
        assert settings.tls is not None
        self.assertEqual(settings.tls.ca, ca)
        self.assertIn(b"BEGIN CERTIFICATE", settings.tls.ca_pem)
        self.assertIsNone(self.parse("  redis: rediss://cache.example\n").cluster.tls)

    def test_errors(self) -> None:
        _, _, ca, _ = pem_files(self)
        for cluster, problem in [
            (f"  redis: redis://cache.example\n  tls:\n    ca: {ca}\n",
             "cluster.tls: applies only to a rediss:// cluster.redis"),
            ("  redis: rediss://cache.example\n  tls:\n    ca: /nonexistent/ca.pem\n",
             "cluster.tls.ca: cannot read '/nonexistent/ca.pem'"),
            ("  redis: rediss://cache.example\n  tls:\n    cafile: x\n", "cluster.tls.cafile: unknown key"),
        ]:
            with self.assertRaises(ConfigError) as e:
                self.parse(cluster)
            self.assertIn(f"/etc/c.yaml: {problem}", str(e.exception))


class OverTLS(TestCase):
    """Two instances sharing one host with ``max_inflight: 2`` through a Redis that
    speaks TLS only on the port crossbar is given."""

    timeout = 60

    async def start(self, trusted: bool, n: int) -> tuple[RedisServer, Held, list[tuple[CrossbarService, str]]]:
        cert, key, ca, other = pem_files(self)
        redis = start_redis(self, tls=(cert, key))
        fake = FakeLlama(["m"])
        held = Held()
        fake.handlers[b"/v1/chat/completions"] = held
        url = await listen(self, fake)
        instances = [await start_crossbar(self, config(url, redis, ca if trusted else other)) for _ in range(n)]
        for service, _ in instances:
            await service.poller.when_first_round_done()
        return redis, held, instances

    def post(self, base: str) -> Deferred[Any]:
        return http_client(self).post(base + "/r/v1/chat/completions", json={"model": "m", "stream": True})

    async def test_counts_shared_over_tls(self) -> None:
        """Both instances join through the TLS port; requests on B take A's room: six
        requests over both never put more than 2 + (2 - 1) at the host."""
        # The sharing is under test, not the fallback when Redis is slow: a reply bound
        # of 1 s, so on a loaded machine a late reply does not send an instance alone.
        self.patch(cluster_module, "BOUND", 1.0)
        redis, held, instances = await self.start(trusted=True, n=2)
        (a, _), (b, _) = instances
        await wait_for(lambda: all(s.cluster is not None and s.cluster.joined and s.cluster.instances() == 2
                                   for s, _ in instances), what="both instances joined over TLS")
        live = redis.command("ZRANGE", "crossbar:live", "0", "-1")
        self.assertEqual(sorted(live), sorted(s.cluster.instance for s, _ in instances))  # type: ignore[union-attr, arg-type]
        first = [self.post(instances[1][1]) for _ in range(2)]
        await wait_for(lambda: a.runtime.inflight.host("h") == 2, what="A sees B's two requests over TLS")
        answers = first + [self.post(instances[i % 2][1]) for i in range(4)]
        # all six arrived: at the host or in either instance's queue
        await wait_for(lambda: len(held.open) + sum(len(s.runtime.queues) for s, _ in instances) == 6,
                       what="every request at the host or queued")
        self.assertLessEqual(held.most, 3)
        self.assertGreaterEqual(sum(len(s.runtime.queues) for s, _ in instances), 3)
        while len(held.arrived) < 6:
            held.end(1)
            await deferLater(reactor, 0.05)
            self.assertLessEqual(held.most, 3)
        held.end(len(held.open))
        results = await DeferredList(answers, consumeErrors=True)
        self.assertEqual([r.code for ok, r in results if ok], [200] * 6)
        for ok, r in results:
            await r.content()

    async def test_untrusted_certificate_fails_closed(self) -> None:
        """A Redis whose certificate is not from ``cluster.tls.ca``: never joined, one
        warning line (not one per reconnection), no count written there, and the
        instance counts alone: ``max_inflight: 2`` holds per instance, so two instances
        put up to 4 at the host."""
        logs = LogCapture(self)
        redis, held, instances = await self.start(trusted=False, n=2)
        await deferLater(reactor, _CONNECTING + 2.5)  # past the start-up grace, several retries
        for service, _ in instances:
            assert service.cluster is not None
            self.assertFalse(service.cluster.joined)
            self.assertTrue(service.runtime.ready)
            self.assertIn(b"crossbar_cluster_up 0.0", service.metrics.render())
        self.assertEqual(redis.command("EXISTS", "crossbar:live"), 0)
        said = [formatEvent(e) for e in logs.events if e.get("log_namespace") == "crossbar.cluster"]
        self.assertEqual(len(said), 2, said)  # one line per instance
        for line in said:
            self.assertIn(f"rediss://127.0.0.1:{redis.tls_port}/0", line)
            self.assertIn("counting this instance's requests alone", line)
            self.assertIn("certificate verify failed", line)  # the reason, not just "not connected"
        answers = [self.post(instances[i % 2][1]) for i in range(4)]
        await wait_for(lambda: len(held.arrived) == 4, what="each instance fills its own room")
        self.assertEqual(held.most, 4)
        held.end(4)
        for d in answers:
            r = await d
            self.assertEqual(r.code, 200)
            await r.content()
        self.assertEqual(len([e for e in logs.events if e.get("log_namespace") == "crossbar.cluster"]), 2)
