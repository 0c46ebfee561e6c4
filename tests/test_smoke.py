"""End-to-end smoke: a loopback upstream behind an in-process crossbar."""

from __future__ import annotations


import treq

from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase

from tests.harness import FakeLlama, http_client, listen, start_crossbar


class SmokeTests(TestCase):
    def test_chat_completion_through_crossbar(self) -> object:
        async def go() -> None:
            upstream = FakeLlama()
            url = await listen(self, upstream)
            service, base = await start_crossbar(
                self,
                f"""
health: {{interval: 0.2, timeout: 1}}
hosts:
  a: {url}
routes:
  r:
    hosts: [a]
""",
            )
            await service.poller.when_first_round_done()
            http = http_client(self)
            response = await http.post(base + "/r/v1/chat/completions", json={"model": "tiny-a", "messages": []})
            body = await treq.json_content(response)
            self.assertEqual(response.code, 200)
            self.assertEqual(response.headers.getRawHeaders(b"x-crossbar-host"), [b"a"])
            self.assertEqual(body["model"], "tiny-a")
            status = await treq.json_content(await http.get(base + "/_crossbar/status"))
            self.assertTrue(status["hosts"]["a"]["healthy"])
            self.assertEqual(status["hosts"]["a"]["loaded"], ["tiny-a"])

        return ensureDeferred(go())

    def test_start_freezes_the_startup_heap(self) -> object:
        """Full GC collections never rescan what start-up loaded (gc.freeze): without it
        they stalled requests for tens of ms (bench/README.md)."""
        import gc

        async def go() -> None:
            gc.unfreeze()
            self.assertEqual(gc.get_freeze_count(), 0)
            await start_crossbar(self, "hosts:\n  a: http://127.0.0.1:9\nroutes:\n  r:\n    hosts: [a]\n")
            self.assertGreater(gc.get_freeze_count(), 0)

        return ensureDeferred(go())
