"""Issue 11 item 5: readiness after a reload (docs/design.md §Operations): every host's
first poll must be done, hosts a reload added included. A running, ready crossbar
reloads a config that adds host ``b``, whose ``/health`` answer the test holds back:
readyz says 503 until that first poll of ``b`` finished, then 200."""

from __future__ import annotations

import os
from typing import Any

import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase
from twisted.web.server import NOT_DONE_YET, Request

from crossbar.config import load_config
from crossbar.process.service import make_service
from tests.harness import FakeLlama, http_client, listen, wait_for


def _config(hosts: dict[str, str]) -> str:
    text = 'listen: "tcp:0:interface=127.0.0.1"\n'
    text += "health: {interval: 60, timeout: 10}\ndrain: {delay: 0.001, grace: 0.001}\n"
    text += "hosts:\n" + "".join(f"  {name}: {url}\n" for name, url in hosts.items())
    return text + "routes:\n  r:\n    hosts: [" + ", ".join(hosts) + "]\n"


class HeldHealth:
    """A ``/health`` handler that leaves each poll unanswered until :meth:`release`.

    :ivar arrived: fires when the first poll arrived.
    """

    def __init__(self) -> None:
        self.held: list[Request] = []
        self.arrived: Deferred[None] = Deferred()

    def __call__(self, request: Request, body: bytes) -> Any:
        self.held.append(request)
        if not self.arrived.called:
            self.arrived.callback(None)
        return NOT_DONE_YET

    def release(self) -> None:
        """Answer every held poll ``200 {"status": "ok"}``."""
        for request in self.held:
            request.setHeader(b"content-type", b"application/json")
            request.write(b'{"status": "ok"}')
            request.finish()
        self.held = []


class ReadinessAfterReloadTests(TestCase):
    timeout = 30

    def test_readyz_waits_for_a_new_hosts_first_poll(self) -> object:
        async def go() -> None:
            a, b = FakeLlama(), FakeLlama()
            held = HeldHealth()
            b.handlers[b"/health"] = held
            url_a, url_b = await listen(self, a), await listen(self, b)
            directory = os.path.abspath(self.mktemp())
            os.makedirs(directory)
            path = os.path.join(directory, "crossbar.yaml")
            with open(path, "w", encoding="utf-8") as f:
                f.write(_config({"a": url_a}))
            service = make_service(load_config(path))
            service.startService()
            self.addCleanup(service.stopService)
            port = await service.web.when_listening()
            readyz = f"http://127.0.0.1:{port.getHost().port}/_crossbar/readyz"  # type: ignore[attr-defined]
            http = http_client(self)

            async def ready_code() -> int:
                response = await http.get(readyz)
                await treq.content(response)
                return int(response.code)

            async def is_ready() -> bool:
                return await ready_code() == 200

            await wait_for(is_ready, 10, "ready before the reload")

            with open(path, "w", encoding="utf-8") as f:
                f.write(_config({"a": url_a, "b": url_b}))
            self.assertTrue(service.reload())
            await held.arrived  # b's first poll is under way, held back
            self.assertEqual(await ready_code(), 503, "ready before the new host was ever polled")
            await deferLater(reactor, 0.3)
            self.assertEqual(await ready_code(), 503, "ready while the new host's first poll is held")
            held.release()
            await wait_for(is_ready, 5, "ready once the new host's first poll finished")
            status = service.runtime.table.get("b")
            assert status is not None
            self.assertTrue(status.polled)

        return ensureDeferred(go())
