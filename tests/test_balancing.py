"""Balancing over loopback hosts (docs/design.md §Choosing a host; §The proxy, rule 10).

A real crossbar runs in-process (:func:`tests.harness.start_crossbar`) in front of
:class:`~tests.harness.FakeLlama` hosts whose completions are answered by a
:class:`Worker`: after a fixed time, or when the test releases them. Each request carries
its sequence number in the body, so the tests see where and in which order every request
went, and how many each host had at once.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredList, ensureDeferred
from twisted.trial.unittest import TestCase
from twisted.web.http_headers import Headers
from twisted.web.server import NOT_DONE_YET, Request

from crossbar.config import load_config
from crossbar.process.service import CrossbarService, make_service
from tests.harness import FakeLlama, http_client, listen, start_crossbar, wait_for
from tests.logs import LogCapture

COMPLETIONS = b"/v1/chat/completions"


class Worker:
    """A ``/v1/chat/completions`` handler that answers after ``delay`` seconds, or (with
    ``delay=None``) when :meth:`release` is called.

    :ivar current: requests it is working on now; :ivar peak: the most at once.
    :ivar seqs: the ``seq`` of every request received, in order.
    :ivar arrivals: shared between workers: ``(seq, name)`` in arrival order.
    """

    def __init__(self, name: str, arrivals: list[tuple[int, str]], delay: float | None = 0.1) -> None:
        self.name = name
        self.arrivals = arrivals
        self.delay = delay
        self.current = 0
        self.peak = 0
        self.seqs: list[int] = []
        self.held: list[Deferred[None]] = []

    def __call__(self, request: Request, body: bytes) -> Any:
        seq = int(json.loads(body)["seq"])
        self.seqs.append(seq)
        self.arrivals.append((seq, self.name))
        self.current += 1
        self.peak = max(self.peak, self.current)
        state = {"done": False}

        def over() -> bool:
            if state["done"]:
                return False
            state["done"] = True
            self.current -= 1
            return True

        def answer(_: object = None) -> None:
            if over():
                request.setHeader(b"content-type", b"application/json")
                request.write(json.dumps({"object": "chat.completion", "seq": seq, "host": self.name}).encode())
                request.finish()

        request.notifyFinish().addBoth(lambda _: over())
        if self.delay is None:
            gate: Deferred[None] = Deferred()
            gate.addCallback(answer)
            self.held.append(gate)
        else:
            reactor.callLater(self.delay, answer)
        return NOT_DONE_YET

    def release(self, n: int | None = None) -> None:
        """Answer the ``n`` oldest held requests (all by default)."""
        n = len(self.held) if n is None else n
        gates, self.held = self.held[:n], self.held[n:]
        for gate in gates:
            gate.callback(None)


def router_models(**states: str) -> dict[str, Any]:
    """A router-mode ``/v1/models`` document: id -> status value."""
    return {"object": "list", "data": [
        {"id": m, "object": "model", "owned_by": "llamacpp", "status": {"value": v}} for m, v in states.items()
    ]}


class Fleet:
    """Hosts with workers, crossbar in front of them."""

    def __init__(self, case: TestCase, names: tuple[str, ...], delay: float | None = 0.1,
                 models: tuple[str, ...] = ("m",)) -> None:
        self.case = case
        self.arrivals: list[tuple[int, str]] = []
        self.hosts = {n: FakeLlama(list(models)) for n in names}
        self.workers = {n: Worker(n, self.arrivals, delay) for n in names}
        for n in names:
            self.hosts[n].handlers[COMPLETIONS] = self.workers[n]
        self.urls: dict[str, str] = {}
        self.http = http_client(case)
        self.service: CrossbarService | None = None
        self.base = ""

    async def listen(self) -> None:
        for name, host in self.hosts.items():
            self.urls[name] = await listen(self.case, host)

    async def start(self, config: str) -> None:
        """crossbar for ``config`` (``{a}``-style placeholders are the hosts' URLs)."""
        await self.listen()
        self.service, self.base = await start_crossbar(self.case, self.fill(config))
        await self.service.poller.when_first_round_done()

    def fill(self, config: str) -> str:
        """``config`` with each ``{name}`` replaced by that host's URL."""
        for name, url in self.urls.items():
            config = config.replace("{" + name + "}", url)
        return config

    def queued(self, route: str = "r") -> int:
        assert self.service is not None
        return self.service.runtime.queues.queued(route)

    def busy(self) -> int:
        return sum(w.current for w in self.workers.values())

    async def ask(self, seq: int, model: str = "m", route: str = "r") -> tuple[int, Any, Any]:
        """POST a completion; returns (status, headers, JSON body)."""
        response = await self.http.post(
            f"{self.base}/{route}/v1/chat/completions",
            data=json.dumps({"model": model, "seq": seq, "messages": [{"role": "user", "content": "hi"}]}).encode(),
            headers=Headers({b"content-type": [b"application/json"]}),
        )
        return response.code, response.headers, await treq.json_content(response)

    def send(self, seq: int, model: str = "m") -> Deferred[tuple[int, Any, Any]]:
        return ensureDeferred(self.ask(seq, model))

    async def status(self) -> Any:
        return await treq.json_content(await self.http.get(self.base + "/_crossbar/status"))

    async def metrics(self) -> str:
        return str(await treq.text_content(await self.http.get(self.base + "/_crossbar/metrics")))


async def gather(ds: list[Deferred[Any]]) -> list[Any]:
    results = await DeferredList(ds, fireOnOneErrback=True, consumeErrors=True)
    return [value for _, value in results]


def fleet_config(hosts: str, route: str, health: str = "{interval: 60, timeout: 5}") -> str:
    """A config whose route ``r`` has cache affinity off (docs/design.md §Cache affinity):
    these tests are about least-busy balancing, and their bodies would carry a key."""
    return f"health: {health}\nhosts:\n{hosts}\nroutes:\n  r:\n{route}\n    affinity: {{key: none}}\n"


class SplitTests(TestCase):
    """Rule 3: least (in-flight + 1) / weight, ties round-robin."""

    timeout = 60

    async def clients(self, fleet: Fleet, n: int, rounds: int) -> list[tuple[int, Any, Any]]:
        async def client(i: int) -> list[tuple[int, Any, Any]]:
            return [await fleet.ask(i * rounds + j) for j in range(rounds)]

        per_client = await gather([ensureDeferred(client(i)) for i in range(n)])
        return [r for rs in per_client for r in rs]

    def test_equal_hosts_split_evenly(self) -> Deferred[None]:
        async def go() -> None:
            fleet = Fleet(self, ("a", "b"))
            await fleet.start(fleet_config("  a: {a}\n  b: {b}", "    hosts: [a, b]"))
            results = await self.clients(fleet, 16, 4)
            self.assertEqual([r[0] for r in results], [200] * 64)
            counts = {n: len(w.seqs) for n, w in fleet.workers.items()}
            self.assertEqual(sum(counts.values()), 64)
            for n in ("a", "b"):
                self.assertAlmostEqual(counts[n], 32, delta=3.2, msg=str(counts))
            # the header names the host that answered
            self.assertEqual({r[1].getRawHeaders(b"x-crossbar-host")[0].decode() for r in results}, {"a", "b"})
            self.assertTrue(all(r[1].getRawHeaders(b"x-crossbar-host")[0].decode() == r[2]["host"] for r in results))
            await wait_for(lambda: fleet.busy() == 0, what="hosts idle")
            self.assertEqual((await fleet.status())["hosts"]["a"]["inflight"], 0)

        return ensureDeferred(go())

    def test_weights_two_to_one(self) -> Deferred[None]:
        """Weights 2 and 1, every request held at its host: each choice sees the earlier
        ones in flight, whatever the machine's load (with answers that end on their own,
        a loaded machine sent requests one at a time and the idle a, 1/2 against 1, took
        33 of 48), so a has twice b's requests, within one; again once all ended."""
        async def go() -> None:
            fleet = Fleet(self, ("a", "b"), delay=None)
            await fleet.start(fleet_config("  a: {url: {a}, weight: 2}\n  b: {b}", "    hosts: [a, b]"))
            for round_ in (1, 2):
                sent = [fleet.send(i) for i in range(24)]
                await wait_for(lambda: fleet.busy() == 24, what="24 in flight")
                a, b = (fleet.workers[n].current for n in ("a", "b"))
                self.assertLessEqual(abs(a - 2 * b), 1, f"round {round_}: a={a} b={b}")
                for w in fleet.workers.values():
                    w.release()
                self.assertEqual([r[0] for r in await gather(sent)], [200] * 24)
                await wait_for(lambda: fleet.busy() == 0, what="hosts idle")

        return ensureDeferred(go())

    def test_primary_takes_what_it_has_room_for(self) -> Deferred[None]:
        async def go() -> None:
            fleet = Fleet(self, ("a", "b"), delay=None)
            log = LogCapture(self)
            await fleet.start(fleet_config("  a: {a}\n  b: {url: {b}, max_inflight: 2}",
                                           "    hosts: [a, b]\n    primary: b"))
            sent = [fleet.send(i) for i in range(5)]
            await wait_for(lambda: fleet.busy() == 5, what="5 in flight")
            self.assertEqual((len(fleet.workers["b"].seqs), len(fleet.workers["a"].seqs)), (2, 3))
            for w in fleet.workers.values():
                w.release()
            await gather(sent)
            picks = sorted((line["host"], line["why"]) for line in log.proxied())
            self.assertEqual(picks, [("a", "loaded least-busy affinity=none")] * 3
                             + [("b", "loaded primary affinity=none")] * 2)

        return ensureDeferred(go())


class QueueTests(TestCase):
    """Rule 4: the route's queue."""

    timeout = 60

    def test_max_inflight_fifo_none_lost(self) -> Deferred[None]:
        async def go() -> None:
            fleet = Fleet(self, ("a", "b"), delay=None)
            log = LogCapture(self)
            await fleet.start(fleet_config("  a: {url: {a}, max_inflight: 2}\n  b: {url: {b}, max_inflight: 2}",
                                           "    hosts: [a, b]"))
            sent = [fleet.send(i) for i in range(4)]
            await wait_for(lambda: fleet.busy() == 4, what="4 in flight")
            for i in range(4, 8):  # one at a time, so crossbar's arrival order is known
                sent.append(fleet.send(i))
                await wait_for(lambda: fleet.queued() == i - 3, what=f"{i - 3} queued")
            await wait_for(lambda: fleet.service and fleet.service.runtime.queues.oldest_wait("r"), what="a wait")

            status = await fleet.status()
            self.assertEqual(status["routes"]["r"]["queued"], 4)
            self.assertGreater(status["routes"]["r"]["oldest_wait_s"], 0)
            self.assertEqual([status["hosts"][h]["inflight"] for h in ("a", "b")], [2, 2])
            self.assertEqual([status["hosts"][h]["max_inflight"] for h in ("a", "b")], [2, 2])
            metrics = await fleet.metrics()
            self.assertIn('crossbar_queued_requests{route="r"} 4.0', metrics)

            # free one slot at a time: each goes to the oldest waiting request
            for k in range(4):
                host = ("a", "b")[k % 2]
                fleet.workers[host].release(1)
                await wait_for(lambda: len(fleet.arrivals) == 5 + k, what=f"dispatch {k}")
                self.assertEqual(fleet.arrivals[-1], (4 + k, host))
                self.assertLessEqual(fleet.busy(), 4)
            self.assertEqual(sorted(seq for seq, _ in fleet.arrivals[:4]), list(range(4)))
            self.assertEqual([seq for seq, _ in fleet.arrivals[4:]], list(range(4, 8)))
            for w in fleet.workers.values():
                w.release()
            results = await gather(sent)
            self.assertEqual(sorted(r[2]["seq"] for r in results), list(range(8)))
            self.assertEqual({r[0] for r in results}, {200})
            self.assertEqual([w.peak for w in fleet.workers.values()], [2, 2])
            self.assertEqual(fleet.queued(), 0)

            lines = sorted(log.proxied(), key=lambda line: line["queued_ms"])
            self.assertEqual(len(lines), 8)
            for line in lines[:4]:
                self.assertEqual((line["queued_ms"], line["why"]), (0.0, "loaded least-busy affinity=none"))
            for line in lines[4:]:
                self.assertGreater(line["queued_ms"], 0)
                self.assertEqual(line["why"], "loaded least-busy queued affinity=none")
            metrics = await fleet.metrics()
            self.assertIn('crossbar_queued_requests{route="r"} 0.0', metrics)
            self.assertIn('crossbar_queue_wait_seconds_count{route="r"} 4.0', metrics)

        return ensureDeferred(go())

    def test_waiting_client_that_leaves_is_removed_and_never_sent(self) -> Deferred[None]:
        async def go() -> None:
            fleet = Fleet(self, ("a",), delay=None)
            log = LogCapture(self)
            await fleet.start(fleet_config("  a: {url: {a}, max_inflight: 1}", "    hosts: [a]"))
            first = fleet.send(0)
            await wait_for(lambda: fleet.busy() == 1, what="first in flight")
            leaver = fleet.send(1)
            leaver.addErrback(lambda f: None)
            await wait_for(lambda: fleet.queued() == 1, what="queued")
            leaver.cancel()  # treq aborts the connection
            await wait_for(lambda: fleet.queued() == 0, timeout=1.0, what="left the queue at once")
            fleet.workers["a"].release()
            self.assertEqual((await first)[0], 200)
            third = fleet.send(2)
            await wait_for(lambda: fleet.busy() == 1, what="third in flight")
            fleet.workers["a"].release()
            self.assertEqual((await third)[0], 200)
            self.assertEqual(fleet.workers["a"].seqs, [0, 2])
            self.assertIn(499, [line["status"] for line in log.proxied()])

        return ensureDeferred(go())

    def test_queue_timeout(self) -> Deferred[None]:
        async def go() -> None:
            fleet = Fleet(self, ("a",), delay=None)
            await fleet.start(fleet_config("  a: {url: {a}, max_inflight: 1}",
                                           "    hosts: [a]\n    queue: {max: 5, timeout: 0.3}"))
            first = fleet.send(0)
            await wait_for(lambda: fleet.busy() == 1, what="first in flight")
            started = time.monotonic()
            code, headers, body = await fleet.ask(1)
            waited = time.monotonic() - started
            self.assertEqual((code, body), (503, {"error": {"code": 503, "message": "all hosts busy", "type": "unavailable_error"}}))
            self.assertEqual(headers.getRawHeaders(b"retry-after"), [b"1"])
            self.assertGreaterEqual(waited, 0.25)
            self.assertEqual(fleet.queued(), 0)
            fleet.workers["a"].release()
            self.assertEqual((await first)[0], 200)
            self.assertEqual(fleet.workers["a"].seqs, [0])

        return ensureDeferred(go())

    def test_queue_full(self) -> Deferred[None]:
        async def go() -> None:
            fleet = Fleet(self, ("a",), delay=None)
            await fleet.start(fleet_config("  a: {url: {a}, max_inflight: 1}",
                                           "    hosts: [a]\n    queue: {max: 1, timeout: 30}"))
            first = fleet.send(0)
            await wait_for(lambda: fleet.busy() == 1, what="first in flight")
            second = fleet.send(1)
            await wait_for(lambda: fleet.queued() == 1, what="second queued")
            code, headers, body = await fleet.ask(2)
            self.assertEqual((code, body), (503, {"error": {"code": 503, "message": "queue full", "type": "unavailable_error"}}))
            self.assertEqual(headers.getRawHeaders(b"retry-after"), [b"1"])
            fleet.workers["a"].release()
            await wait_for(lambda: fleet.busy() == 1, what="second in flight")
            fleet.workers["a"].release()
            self.assertEqual([(await d)[0] for d in (first, second)], [200, 200])
            self.assertEqual(fleet.workers["a"].seqs, [0, 1])

        return ensureDeferred(go())

    def test_queue_off(self) -> Deferred[None]:
        async def go() -> None:
            fleet = Fleet(self, ("a",), delay=None)
            await fleet.start(fleet_config("  a: {url: {a}, max_inflight: 1}",
                                           "    hosts: [a]\n    queue: {max: 0}"))
            first = fleet.send(0)
            await wait_for(lambda: fleet.busy() == 1, what="first in flight")
            started = time.monotonic()
            code, headers, body = await fleet.ask(1)
            self.assertLess(time.monotonic() - started, 1.0)
            self.assertEqual((code, body), (503, {"error": {"code": 503, "message": "all hosts busy", "type": "unavailable_error"}}))
            self.assertEqual(headers.getRawHeaders(b"retry-after"), [b"1"])
            fleet.workers["a"].release()
            self.assertEqual((await first)[0], 200)

        return ensureDeferred(go())

    def test_host_that_comes_back_drains_the_queue(self) -> Deferred[None]:
        async def go() -> None:
            fleet = Fleet(self, ("a", "b"), delay=None)
            fleet.hosts["b"].health_code = 503
            log = LogCapture(self)
            await fleet.start(fleet_config(
                "  a: {url: {a}, max_inflight: 1}\n  b: {b}", "    hosts: [a, b]",
                health="{interval: 0.1, timeout: 2, recovery_polls: 1}",
            ))
            first = fleet.send(0)
            await wait_for(lambda: fleet.busy() == 1, what="first in flight")
            second = fleet.send(1)
            await wait_for(lambda: fleet.queued() == 1, what="second queued")
            fleet.hosts["b"].health_code = 200
            await wait_for(lambda: fleet.workers["b"].seqs == [1], what="second sent to b")
            fleet.workers["b"].release()
            self.assertEqual((await second)[0], 200)
            fleet.workers["a"].release()
            self.assertEqual((await first)[0], 200)
            whys = {line["host"]: line["why"] for line in log.proxied()}
            self.assertEqual(whys["b"], "loaded least-busy queued affinity=none")

        return ensureDeferred(go())

    def test_model_that_finishes_loading_drains_the_queue(self) -> Deferred[None]:
        """A host loading the model is a worse tier than a full host that has it
        loaded: the request waits, and goes there once the model is loaded."""

        async def go() -> None:
            fleet = Fleet(self, ("a", "b"), delay=None)
            fleet.hosts["b"].models = router_models(m="loading", other="loaded")
            log = LogCapture(self)
            await fleet.start(fleet_config(
                "  a: {url: {a}, max_inflight: 1}\n  b: {b}", "    hosts: [a, b]",
                health="{interval: 0.1, timeout: 2}",
            ))
            first = fleet.send(0)
            await wait_for(lambda: fleet.busy() == 1, what="first in flight")
            second = fleet.send(1)
            await wait_for(lambda: fleet.queued() == 1, what="second queued")
            status = await fleet.status()
            self.assertEqual(status["hosts"]["b"]["loading"], ["m"])
            self.assertEqual(fleet.workers["b"].seqs, [])
            fleet.hosts["b"].models = router_models(m="loaded", other="loaded")
            await wait_for(lambda: fleet.workers["b"].seqs == [1], what="second sent to b")
            for w in fleet.workers.values():
                w.release()
            self.assertEqual([(await d)[0] for d in (first, second)], [200, 200])
            whys = {line["host"]: line["why"] for line in log.proxied()}
            self.assertEqual(whys, {"a": "loaded least-busy affinity=none",
                                    "b": "loaded least-busy queued affinity=none"})

        return ensureDeferred(go())


class RouteModelsTests(TestCase):
    """Rule 10: ``GET /{route}/v1/models`` from the health table."""

    timeout = 30

    def test_models_of_every_healthy_host(self) -> Deferred[None]:
        async def go() -> None:
            fleet = Fleet(self, ("a", "b", "c"), models=("m",))
            fleet.hosts["b"].models = router_models(m="unloaded", big="loading", small="loaded")
            fleet.hosts["c"].health_code = 503
            fleet.hosts["c"].models = {"object": "list", "data": [{"id": "hidden"}]}
            await fleet.start(fleet_config("  a: {a}\n  b: {b}\n  c: {c}", "    hosts: [a, b, c]"))
            polls = sum(len(h.seen) for h in fleet.hosts.values())
            response = await fleet.http.get(fleet.base + "/r/v1/models?ignored=1")
            self.assertEqual(response.code, 200)
            self.assertEqual(response.headers.getRawHeaders(b"content-type"), [b"application/json"])
            raw = await response.content()
            doc = json.loads(raw)
            self.assertEqual([e["id"] for e in doc["data"]], ["big", "m", "small"])
            by_id = {e["id"]: e for e in doc["data"]}
            self.assertEqual(by_id["m"]["crossbar"], {"hosts": {"a": "loaded", "b": "available"}})
            self.assertNotIn("status", by_id["m"])  # a's entry: a lists it first
            self.assertEqual(by_id["big"]["crossbar"], {"hosts": {"b": "loading"}})
            self.assertEqual(by_id["small"]["status"], {"value": "loaded"})
            self.assertEqual(sum(len(h.seen) for h in fleet.hosts.values()), polls)  # no upstream request

            head = await fleet.http.head(fleet.base + "/r/v1/models")
            self.assertEqual(head.code, 200)
            self.assertEqual(head.headers.getRawHeaders(b"content-length"), [str(len(raw)).encode()])
            self.assertEqual(await head.content(), b"")

        return ensureDeferred(go())

    def test_no_healthy_host(self) -> Deferred[None]:
        async def go() -> None:
            fleet = Fleet(self, ("a",))
            fleet.hosts["a"].health_code = 503
            await fleet.start(fleet_config("  a: {a}", "    hosts: [a]"))
            response = await fleet.http.get(fleet.base + "/r/v1/models")
            self.assertEqual((response.code, await treq.json_content(response)), (503, {"error": {"code": 503, "message": "no healthy host", "type": "unavailable_error"}}))

        return ensureDeferred(go())


class ReloadTests(TestCase):
    """A reload changes weights, limits and the primary under load: nothing dropped."""

    timeout = 60

    def test_reload_applies_new_limits_to_waiting_requests(self) -> Deferred[None]:
        async def go() -> None:
            fleet = Fleet(self, ("a", "b"), delay=None)
            await fleet.listen()
            path = Path(self.mktemp())
            head = "listen: \"tcp:0:interface=127.0.0.1\"\ndrain: {delay: 0.001, grace: 0.001}\n"
            path.write_text(head + fleet.fill(fleet_config(
                "  a: {url: {a}, max_inflight: 1}\n  b: {url: {b}, max_inflight: 1}",
                "    hosts: [a, b]")))
            service = fleet.service = make_service(load_config(str(path)))
            service.startService()
            self.addCleanup(service.stopService)
            port = await service.web.when_listening()
            fleet.base = f"http://127.0.0.1:{port.getHost().port}"  # type: ignore[attr-defined]
            await service.poller.when_first_round_done()
            log = LogCapture(self)

            sent = [fleet.send(0), fleet.send(1)]
            await wait_for(lambda: fleet.busy() == 2, what="2 in flight")
            for i in (2, 3):  # one at a time, so crossbar's arrival order is known
                sent.append(fleet.send(i))
                await wait_for(lambda: fleet.queued() == i - 1, what=f"{i - 1} queued")

            path.write_text(head + fleet.fill(fleet_config(
                "  a: {url: {a}, max_inflight: 3, weight: 2}\n  b: {url: {b}, max_inflight: 2}",
                "    hosts: [a, b]\n    primary: b")))
            self.assertTrue(service.reload())
            await wait_for(lambda: fleet.busy() == 4, what="queued requests dispatched under the new limits")
            self.assertEqual(fleet.queued(), 0)
            self.assertEqual(fleet.arrivals[2:], [(2, "b"), (3, "a")])
            sent.append(fleet.send(4))  # b (primary) is full: a, under its new limit
            await wait_for(lambda: fleet.busy() == 5, what="fifth in flight")
            self.assertEqual(fleet.arrivals[4], (4, "a"))
            status = await fleet.status()
            self.assertEqual((status["hosts"]["a"]["weight"], status["hosts"]["a"]["max_inflight"]), (2.0, 3))
            self.assertEqual(status["routes"]["r"]["primary"], "b")
            self.assertEqual([status["hosts"][h]["inflight"] for h in ("a", "b")], [3, 2])
            for w in fleet.workers.values():
                w.release()
            results = await gather(sent)
            self.assertEqual(sorted(r[2]["seq"] for r in results), list(range(5)))
            self.assertEqual({r[0] for r in results}, {200})
            self.assertEqual((fleet.workers["a"].peak, fleet.workers["b"].peak), (3, 2))
            whys = {line["host"] + str(i): line["why"] for i, line in enumerate(log.proxied())}
            self.assertIn("loaded primary queued affinity=none", whys.values())

        return ensureDeferred(go())
