"""The fair order through crossbar on loopback (docs/design.md §Access, "Fair shares";
§Choosing a host, rule 4): a host of one slot holds every request until the test lets
one go, so what the host receives next is what the queue chose."""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.defer import Deferred, ensureDeferred
from twisted.trial.unittest import TestCase
from twisted.web.server import NOT_DONE_YET, Request

from crossbar.process.service import CrossbarService
from tests.harness import FakeLlama, http_client, listen, start_crossbar, wait_for


class Hold:
    """A chat-completions handler that keeps every request open until :meth:`release_one`
    answers the oldest (15 tokens, as llama-server's timings report them).

    :ivar held: the requests being held, in arrival order.
    :ivar order: the ``who`` field of every request received, in order.
    """

    def __init__(self) -> None:
        self.held: list[Request] = []
        self.order: list[str] = []

    def __call__(self, request: Request, body: bytes) -> Any:
        self.held.append(request)
        self.order.append(json.loads(body)["who"])
        return NOT_DONE_YET

    def release_one(self) -> None:
        request = self.held.pop(0)
        request.setHeader(b"content-type", b"application/json")
        request.write(b'{"object": "chat.completion", "choices": [], '
                      b'"timings": {"prompt_n": 10, "cache_n": 0, "predicted_n": 5}}')
        request.finish()


KEYS = (
    "      ci:\n        secret: ci-secret\n        priority: -1\n"
    "      alice:\n        secret: alice-secret\n"
    "      bob:\n        secret: bob-secret\n"
    "      big:\n        secret: big-secret\n        share: 2\n"
)


class FairQueue(TestCase):
    timeout = 30

    async def start(self, queue: str = "{max: 100, timeout: 20}") -> tuple[CrossbarService, str, Hold]:
        host = FakeLlama(["m"])
        hold = self.hold = Hold()
        host.handlers[b"/v1/chat/completions"] = hold
        url = await listen(self, host)
        service, base = await start_crossbar(self, (
            "health: {interval: 60, timeout: 5}\n"
            f"hosts:\n  h:\n    url: {url}\n    max_inflight: 1\n"
            f"routes:\n  r:\n    hosts: [h]\n    queue: {queue}\n    keys:\n{KEYS}"))
        await service.poller.when_first_round_done()
        self.client = http_client(self)
        self.base = base
        self.answers: list[Deferred[int]] = []
        return service, base, hold

    def send(self, key: str, who: str) -> Deferred[int]:
        async def go() -> int:
            response = await self.client.post(self.base + "/r/v1/chat/completions", json={"model": "m", "who": who},
                                              headers={"Authorization": f"Bearer {key}-secret"})
            await response.content()
            return int(response.code)

        d = ensureDeferred(go())
        self.answers.append(d)
        return d

    async def enqueue(self, service: CrossbarService, key: str, who: str) -> None:
        """Send a request and wait until it waits in the queue (so arrivals are in order)."""
        n = service.runtime.queues.queued("r")
        self.send(key, who)
        await self.queued(service, n + 1)

    async def queued(self, service: CrossbarService, n: int) -> None:
        await wait_for(lambda: service.runtime.queues.queued("r") == n, what=f"{n} queued")

    async def drain_in_order(self, total: int) -> list[str]:
        """Let the held requests go one at a time until ``total`` reached the host."""
        while len(self.hold.order) < total or self.hold.held:
            await wait_for(lambda: self.hold.held, what="a request at the host")
            self.hold.release_one()
            await wait_for(lambda: self.hold.held or len(self.hold.order) >= total, what="the next one")
        for d in self.answers:
            self.assertEqual(await d, 200)
        return self.hold.order

    async def test_interactive_key_passes_a_batch_flood(self) -> None:
        service, base, hold = await self.start()
        self.send("ci", "ci0")
        await wait_for(lambda: hold.held, what="ci0 at the host")
        for i in range(1, 7):
            await self.enqueue(service, "ci", f"ci{i}")
        await self.enqueue(service, "alice", "alice0")
        status = await (await self.client.get(base + "/_crossbar/status")).json()
        self.assertEqual(status["routes"]["r"]["waiting"], {
            "alice": {"priority": 0, "share": 1.0, "queued": 1, "inflight": 0},
            "ci": {"priority": -1, "share": 1.0, "queued": 6, "inflight": 1},
        })
        order = await self.drain_in_order(8)
        self.assertEqual(order, ["ci0", "alice0"] + [f"ci{i}" for i in range(1, 7)])

    async def test_equal_keys_take_turns(self) -> None:
        """alice sends five, then bob two. One slot: each key has none in flight when it
        frees, so the tokens spent in the last minute decide (then arrival): they take turns."""
        service, _, hold = await self.start()
        self.send("alice", "a0")
        await wait_for(lambda: hold.held, what="a0 at the host")
        for i in range(1, 5):
            await self.enqueue(service, "alice", f"a{i}")
        await self.enqueue(service, "bob", "b0")
        await self.enqueue(service, "bob", "b1")
        order = await self.drain_in_order(7)
        self.assertEqual(order, ["a0", "b0", "a1", "b1", "a2", "a3", "a4"])

    async def test_the_queue_limits_hold(self) -> None:
        """queue.max and queue.timeout hold for keyed requests, whatever their priority."""
        service, base, hold = await self.start("{max: 2, timeout: 0.5}")
        self.send("ci", "ci0")
        await wait_for(lambda: hold.held, what="ci0 at the host")
        await self.enqueue(service, "ci", "ci1")
        await self.enqueue(service, "alice", "alice0")
        full = await self.client.post(base + "/r/v1/chat/completions", json={"model": "m", "who": "x"},
                                      headers={"Authorization": "Bearer bob-secret"})
        self.assertEqual((full.code, (await full.json())["error"]["message"]), (503, "queue full"))
        self.assertEqual([await d for d in self.answers[1:]], [503, 503])  # queue.timeout
        self.assertEqual(service.runtime.queues.status("r"), {})
        hold.release_one()
        self.assertEqual(await self.answers[0], 200)

    async def test_a_client_that_leaves_is_removed(self) -> None:
        service, _, hold = await self.start()
        self.send("ci", "ci0")
        await wait_for(lambda: hold.held, what="ci0 at the host")
        await self.enqueue(service, "alice", "alice0")
        self.answers[1].cancel()  # the client closes its connection while waiting
        await self.queued(service, 0)
        self.assertEqual(service.runtime.queues.status("r"), {})
        self.answers.pop().addErrback(lambda _: None)
        await self.enqueue(service, "bob", "b0")
        order = await self.drain_in_order(2)
        self.assertEqual(order, ["ci0", "b0"])
