"""``max_inflight: slots``: room from the host's own slot count (issue 22; docs/design.md
§Choosing a host, rule 2).

``SlotsReadTests`` drive the real :class:`HealthPoller` with a :class:`FakeProbe` and a
``Clock``: when ``/props`` is read (first good poll, each recovery, never in router
mode). ``ParseSlotsTests`` and ``RoomTests`` are the pure parts. ``RealSlotsTests`` run
crossbar against a real llama-server started with ``-np 3``: the room is 3, status
says so and where it came from.
"""

from __future__ import annotations

import json

import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, ensureDeferred, gatherResults
from twisted.internet.task import Clock, LoopingCall
from twisted.trial.unittest import SynchronousTestCase, TestCase

from crossbar.config import Host
from crossbar.hosts.balance import has_room, limit_in_force
from crossbar.hosts.health import HealthTable, HostStatus
from crossbar.hosts.models import ModelList, parse_models
from crossbar.hosts.poller import HealthPoller, PollFailed, parse_slots
from tests.fakes import FakeProbe
from tests.harness import http_client, require_llama_server, start_crossbar
from tests.logs import LogCapture
from tools.llama_server import LlamaServer

URL = "http://a.test"
INTERVAL = 2.0
TIMEOUT = 5.0


class ParseSlotsTests(SynchronousTestCase):
    def test_total_slots(self) -> None:
        self.assertEqual(parse_slots(b'{"total_slots": 3, "model_path": "/m.gguf"}'), 3)

    def test_refused(self) -> None:
        for body, reason in (
            (b"<html>", "bad JSON"), (b"[3]", "no total_slots"), (b"{}", "no total_slots"),
            (b'{"total_slots": 0}', "total_slots is not a whole number >= 1"),
            (b'{"total_slots": true}', "total_slots is not a whole number >= 1"),
            (b'{"total_slots": 2.5}', "total_slots is not a whole number >= 1"),
        ):
            with self.assertRaises(ValueError) as caught:
                parse_slots(body)
            self.assertTrue(str(caught.exception).startswith(reason), (body, caught.exception))

    def test_router_mode_seen_in_the_model_list(self) -> None:
        self.assertTrue(parse_models(b'{"data": [{"id": "a", "status": {"value": "unloaded"}}]}').router)
        self.assertFalse(parse_models(b'{"data": [{"id": "a"}]}').router)


class RoomTests(SynchronousTestCase):
    def test_limit_in_force_and_its_source(self) -> None:
        slots = Host("a", URL, max_inflight_slots=True)
        self.assertEqual(limit_in_force(slots, HostStatus()), (None, "slots"))  # not known yet: no limit
        self.assertEqual(limit_in_force(slots, HostStatus(slots=3)), (3, "slots"))
        self.assertEqual(limit_in_force(slots, HostStatus(slots=3, router=True)), (None, "slots"))
        self.assertEqual(limit_in_force(Host("a", URL, max_inflight=4), HostStatus(slots=3)), (4, "config"))
        self.assertEqual(limit_in_force(Host("a", URL), HostStatus(slots=3)), (None, None))

    def test_room(self) -> None:
        slots = Host("a", URL, max_inflight_slots=True)
        self.assertTrue(has_room(slots, 1000, HostStatus()))
        self.assertTrue(has_room(slots, 2, HostStatus(slots=3)))
        self.assertFalse(has_room(slots, 3, HostStatus(slots=3)))
        self.assertFalse(has_room(Host("a", URL, max_inflight=2), 2))


class SlotsReadTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1000)
        self.table = HealthTable([URL], 2, 1, self.clock.seconds)
        self.probe = FakeProbe()
        self.wants = True
        self.poller = HealthPoller(self.table, {URL: URL}, self.probe, INTERVAL, TIMEOUT, self.clock,
                                   wants_slots=lambda name: self.wants)
        self.poller.startService()
        self.addCleanup(lambda: self.poller.stopService() if self.poller.running else None)

    def status(self) -> HostStatus:
        status = self.table.get(URL)
        assert status is not None
        return status

    def good_poll(self, models: ModelList | tuple[str, ...] = ("m",)) -> None:
        self.probe.pending(URL)[0].callback(models)
        self.clock.advance(INTERVAL)

    def bad_poll(self) -> None:
        self.probe.fail(URL)
        self.clock.advance(INTERVAL)

    def answer_slots(self, slots: int) -> None:
        [d] = [d for _, d in self.probe.slot_reads if not d.called]
        d.callback(slots)

    def test_read_after_the_first_good_poll_and_each_recovery(self) -> None:
        self.good_poll()
        self.assertEqual(len(self.probe.slot_reads), 1)
        self.assertIsNone(self.status().slots)  # until known: no limit
        self.answer_slots(3)
        self.assertEqual(self.status().slots, 3)
        for _ in range(3):
            self.good_poll()
        self.assertEqual(len(self.probe.slot_reads), 1)  # known, still healthy: not again
        self.bad_poll()
        self.assertEqual(self.status().slots, 3)  # kept while down (no request goes there)
        self.good_poll()  # 1 of recovery_polls=2: not healthy yet
        self.assertEqual(len(self.probe.slot_reads), 1)
        self.good_poll()  # recovered: read anew (it may have restarted with another -np)
        self.assertEqual(len(self.probe.slot_reads), 2)
        self.answer_slots(5)
        self.assertEqual(self.status().slots, 5)

    def test_never_for_a_router_mode_host(self) -> None:
        router = ModelList(available=("m",), router=True)
        for _ in range(3):
            self.good_poll(router)
        self.assertEqual(self.probe.slot_reads, [])
        self.assertTrue(self.status().healthy)

    def test_never_without_max_inflight_slots(self) -> None:
        self.wants = False
        for _ in range(3):
            self.good_poll()
        self.assertEqual(self.probe.slot_reads, [])

    def test_a_failed_read_fails_nothing_and_is_tried_again(self) -> None:
        events = LogCapture(self).events
        self.good_poll()
        [(_, d)] = self.probe.slot_reads
        d.errback(PollFailed("props: HTTP 404"))
        self.assertTrue(self.status().healthy)
        self.assertIsNone(self.status().slots)
        warned = [e for e in events if e.get("reason") == "props: HTTP 404"]
        self.assertEqual(len(warned), 1)
        self.good_poll()  # still unknown: read again at the next good poll
        self.assertEqual(len(self.probe.slot_reads), 2)
        self.probe.slot_reads[1][1].errback(PollFailed("props: HTTP 404"))
        self.assertEqual(len([e for e in events if e.get("reason") == "props: HTTP 404"]), 1)  # said once

    def test_a_hung_read_is_bounded_by_the_poll_timeout(self) -> None:
        self.good_poll()
        [(_, d)] = self.probe.slot_reads
        for _ in range(3):  # the polls meanwhile are good: 3 intervals > the timeout
            self.good_poll()
        self.assertTrue(d.called)
        self.assertTrue(self.status().healthy)
        self.assertIsNone(self.status().slots)

    def test_stop_cancels_a_read_and_records_nothing(self) -> None:
        self.good_poll()
        [(_, d)] = self.probe.slot_reads
        self.poller.stopService()
        self.assertTrue(d.called)
        self.assertIsNone(self.status().slots)


class RealSlotsTests(TestCase):
    timeout = 120

    def setUp(self) -> None:
        require_llama_server(self)
        self.server = LlamaServer("single", extra_args=["-np", "3", "-c", "4096"])
        self.addCleanup(self.server.stop)
        self.server.start(timeout=60)

    def test_room_is_the_hosts_slot_count(self) -> Deferred[None]:
        """A llama-server with ``-np 3`` and ``max_inflight: slots``: status says 3 from
        ``slots``; five streams at once: three go to the host, two wait in crossbar's
        queue (never inside llama-server)."""

        async def go() -> None:
            service, base = await start_crossbar(
                self,
                "health: {interval: 60, timeout: 5}\n"
                f"hosts:\n  a: {{url: {self.server.url}, max_inflight: slots}}\n"
                "routes:\n  r:\n    hosts: [a]\n    default_model: tiny-a\n    queue: {max: 10, timeout: 60}\n",
            )
            await service.poller.when_first_round_done()
            http = http_client(self)
            for _ in range(200):
                status = await (await http.get(base + "/_crossbar/status")).json()
                if status["hosts"]["a"]["max_inflight"] is not None:
                    break
                await treq_sleep(0.02)
            host = status["hosts"]["a"]
            self.assertEqual((host["max_inflight"], host["max_inflight_source"]), (3, "slots"))
            # Issue 30 item 3: the dashboard shows the same limit (it showed no limit, "∞").
            page = await (await http.get(base + "/_crossbar/dashboard.json")).json()
            [shown] = [h for h in page["hosts"] if h["name"] == "a"]
            self.assertEqual((shown["max_inflight"], shown["max_inflight_source"]), (3, "slots"))
            # Streams of ~1,000 tokens (seconds each): all five are in crossbar long
            # before the first ends.
            body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000,
                               "stream": True}).encode()
            inflight: list[int] = []
            queued: list[int] = []

            def sample() -> None:
                inflight.append(service.runtime.inflight.host("a"))
                queued.append(service.runtime.queued("r"))

            sampler = LoopingCall(sample)
            sampler.start(0.005)
            self.addCleanup(lambda: sampler.running and sampler.stop())

            async def one() -> int:
                response = await http.post(base + "/r/v1/chat/completions", data=body,
                                           headers={"Content-Type": "application/json"})
                await treq.content(response)
                return int(response.code)

            codes = await gatherResults([ensureDeferred(one()) for _ in range(5)])
            sampler.stop()
            self.assertEqual(codes, [200] * 5)
            self.assertEqual(max(inflight), 3, "the host never had its 3 slots busy, or more")
            self.assertEqual(max(queued), 2, "the two beyond the slots did not wait in crossbar")

        return ensureDeferred(go())


def treq_sleep(seconds: float) -> Deferred[None]:
    from twisted.internet.task import deferLater

    return deferLater(reactor, seconds)
