"""A request that arrives before a host of its route has had its first poll (a new or
restarted worker or instance) waits for that poll instead of being answered ``model
not found`` or ``no healthy host`` (docs/design.md §Several crossbars, last bullet):
here a router-mode host answers its first poll at once and the host that serves the
model answers late, on real loopback sockets."""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.defer import ensureDeferred
from twisted.trial.unittest import TestCase
from twisted.web.server import NOT_DONE_YET, Request

from tests.harness import FakeLlama, http_client, listen, start_crossbar, upstream_requests, wait_for


class LateHealth:
    """A ``/health`` handler that holds every poll until :meth:`release`."""

    def __init__(self) -> None:
        self.held: list[Request] = []
        self.released = False

    def __call__(self, request: Request, body: bytes) -> Any:
        if self.released:
            return b'{"status":"ok"}'
        self.held.append(request)
        return NOT_DONE_YET

    def release(self) -> None:
        self.released = True
        for request in self.held:
            request.setHeader(b"content-type", b"application/json")
            request.write(b'{"status":"ok"}')
            request.finish()
        self.held.clear()


def router_host() -> FakeLlama:
    """A llama-server in router mode that can load ``other`` but not ``m1``."""
    host = FakeLlama()
    host.models = {"object": "list", "data": [{"id": "other", "status": {"value": "unloaded"}}]}
    return host


class FirstPollWaitTests(TestCase):
    async def start(self, queue: str = "{max: 5, timeout: 20}") -> tuple[Any, str, FakeLlama, LateHealth]:
        router, single = router_host(), FakeLlama(["m1"])
        single.handlers[b"/health"] = late = LateHealth()
        urls = [await listen(self, h) for h in (router, single)]
        text = ("health: {interval: 60, timeout: 30}\n"
                f"hosts:\n  router: {urls[0]}\n  single: {urls[1]}\n"
                f"routes:\n  r:\n    hosts: [router, single]\n    queue: {queue}\n")
        service, base = await start_crossbar(self, text)
        await wait_for(lambda: getattr(service.table.get("router"), "polled", False), what="the router polled")
        await wait_for(lambda: late.held, what="the late host's poll held")
        return service, base, single, late

    async def test_waits_for_the_late_host_instead_of_model_not_found(self) -> None:
        service, base, single, late = await self.start()
        client = http_client(self)
        sent = ensureDeferred(client.post(base + "/r/v1/chat/completions", json={"model": "m1"}))
        await wait_for(lambda: service.runtime.queued("r") == 1, what="the request waiting for the first poll")
        self.assertEqual(upstream_requests(single), [])
        late.release()
        response = await sent
        self.assertEqual(response.code, 200)
        self.assertEqual(json.loads(await response.content())["model"], "m1")
        self.assertEqual(response.headers.getRawHeaders(b"x-crossbar-host"), [b"single"])
        self.assertEqual(len(upstream_requests(single)), 1)
        self.assertEqual(service.runtime.queued("r"), 0)

    async def test_queue_timeout_still_bounds_the_wait(self) -> None:
        service, base, _, late = await self.start(queue="{max: 5, timeout: 0.2}")
        response = await http_client(self).post(base + "/r/v1/chat/completions", json={"model": "m1"})
        self.assertEqual(response.code, 503)
        self.assertIn(b"all hosts busy", await response.content())
        late.release()

    async def test_model_list_waits_for_every_first_poll(self) -> None:
        """``GET /r/v1/models`` in the first poll round waits too: neither a 503 nor a
        list without the models of the host not polled yet."""
        service, base, _, late = await self.start()
        listed = ensureDeferred(http_client(self).get(base + "/r/v1/models"))
        await wait_for(lambda: service.runtime.queued("r") == 1, what="the model list waiting")
        late.release()
        response = await listed
        self.assertEqual(response.code, 200)
        doc = json.loads(await response.content())
        self.assertEqual([m["id"] for m in doc["data"]], ["m1", "other"])
        self.assertEqual(service.runtime.queued("r"), 0)

    async def test_model_list_at_the_queue_timeout_is_what_the_polls_gave(self) -> None:
        _, base, _, late = await self.start(queue="{max: 5, timeout: 0.2}")
        response = await http_client(self).get(base + "/r/v1/models")
        self.assertEqual(response.code, 200)
        self.assertEqual([m["id"] for m in json.loads(await response.content())["data"]], ["other"])
        late.release()
