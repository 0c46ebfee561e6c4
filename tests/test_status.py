"""``GET /_crossbar/status`` reflects the health table (docs/design.md §Operations and §"The
health table"): in-process crossbar, real loopback hosts."""

from __future__ import annotations

import socket
import time
from datetime import datetime
from typing import Any

import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase

from tests.harness import FakeLlama, http_client, listen, start_crossbar

FIELDS = {"url", "healthy", "loaded", "loading", "available", "last_ok", "last_err", "consecutive", "failures",
          "inflight", "weight", "max_inflight", "max_inflight_source", "draining", "leaving", "tokens_per_s",
          "cached_share", "models_max", "models", "last_load", "last_unload"}


def free_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port: int = sock.getsockname()[1]
    sock.close()
    return port


def parse_rfc3339(text: str) -> float:
    """Seconds since the epoch of an RFC 3339 timestamp (offset required)."""
    stamp = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if stamp.tzinfo is None:
        raise ValueError(f"no UTC offset in {text!r}")
    return stamp.timestamp()


class StatusTests(TestCase):
    timeout = 60

    def test_status_shape_for_every_host(self) -> Deferred[None]:
        async def go() -> None:
            good = FakeLlama(["tiny-b", "tiny-a"])
            good.events = 200
            good.event_delay = 0.02
            good_url = await listen(self, good)
            sick = FakeLlama()
            sick.health_code = 503
            sick_url = await listen(self, sick)
            gone_url = f"http://127.0.0.1:{free_port()}"
            service, base = await start_crossbar(
                self,
                f"""
health: {{interval: 0.1, timeout: 2, recovery_polls: 2}}
hosts:
  good: {good_url}
  sick: {sick_url}/
  gone:
    url: {gone_url}
routes:
  r:
    hosts: [good, sick, gone]
""",
            )
            await service.poller.when_first_round_done()
            while (service.table.get("sick").failures < 2):  # type: ignore[union-attr]
                await deferLater(reactor, 0.05)
            http = http_client(self)

            # a streaming request in flight to "good"
            stream = await http.post(base + "/r/v1/chat/completions",
                                      json={"model": "tiny-a", "stream": True, "messages": []})
            self.assertEqual(stream.code, 200)
            self.addCleanup(lambda: stream.deliverBody(_Drop()))

            before = time.time()
            response = await http.get(base + "/_crossbar/status")
            self.assertEqual(response.code, 200)
            self.assertEqual(response.headers.getRawHeaders(b"content-type"), [b"application/json"])
            doc: Any = await treq.json_content(response)
            self.assertEqual(set(doc), {"hosts", "routes"})
            hosts = doc["hosts"]
            self.assertEqual(set(hosts), {"good", "sick", "gone"})
            for name, entry in hosts.items():
                self.assertEqual(set(entry), FIELDS, name)

            g = hosts["good"]
            self.assertEqual(g["url"], good_url)
            self.assertIs(g["healthy"], True)
            self.assertEqual(g["loaded"], ["tiny-a", "tiny-b"])
            self.assertEqual(g["last_err"], "")
            self.assertGreaterEqual(g["consecutive"], 1)
            self.assertEqual(g["failures"], 0)
            self.assertEqual(g["inflight"], 1)
            self.assertIsInstance(g["last_ok"], str)
            self.assertTrue(g["last_ok"].endswith("Z") or g["last_ok"][-6] in "+-", g["last_ok"])
            self.assertLess(abs(parse_rfc3339(g["last_ok"]) - before), 30)

            s = hosts["sick"]
            self.assertEqual(s["url"], sick_url)  # trailing slash trimmed
            self.assertIs(s["healthy"], False)
            self.assertEqual(s["loaded"], [])
            self.assertIsNone(s["last_ok"])
            self.assertEqual(s["last_err"], "health: HTTP 503")
            self.assertEqual(s["consecutive"], 0)
            self.assertGreaterEqual(s["failures"], 2)
            self.assertEqual(s["inflight"], 0)

            x = hosts["gone"]
            self.assertIs(x["healthy"], False)
            self.assertIsNone(x["last_ok"])
            self.assertTrue(x["last_err"].startswith("health: "), x["last_err"])
            self.assertGreaterEqual(x["failures"], 1)

            # recovery shows up: sick comes back after recovery_polls good polls
            sick.health_code = 200
            while not service.table.is_healthy("sick"):
                await deferLater(reactor, 0.05)
            doc = await treq.json_content(await http.get(base + "/_crossbar/status"))
            s = doc["hosts"]["sick"]
            self.assertIs(s["healthy"], True)
            self.assertGreaterEqual(s["consecutive"], 2)
            self.assertEqual(s["failures"], 0)
            self.assertEqual(s["last_err"], "")
            self.assertEqual(s["loaded"], ["tiny-a"])
            self.assertIsNotNone(s["last_ok"])

            # a mark-down shows with its prefix and keeps what was loaded (polling
            # stopped first, so no poll lands between the mark-down and the read)
            await service.poller.stopService()
            service.table.mark_down("good", "connection reset")
            doc = await treq.json_content(await http.get(base + "/_crossbar/status"))
            g = doc["hosts"]["good"]
            self.assertEqual((g["healthy"], g["last_err"], g["loaded"]),
                             (False, "marked down: connection reset", ["tiny-a", "tiny-b"]))

        return ensureDeferred(go())


class _Drop:
    """Reads and drops a body; closes the connection at once."""

    def makeConnection(self, transport: Any) -> None:
        transport.stopProducing()

    def dataReceived(self, data: bytes) -> None:
        pass

    def connectionLost(self, reason: Any) -> None:
        pass
