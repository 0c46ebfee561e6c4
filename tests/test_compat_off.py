"""The suite's core with every touchpoint off (issue 30: a fence that holds): crossbar
keeps its behaviour on the libraries' own code paths when its start-up checks fail.

- In this process: the fences' FALLBACK set, then the request path's own tests run
  again as they are (a request, streams, a slow client's backpressure, failures).
- In a real twistd child whose Python looks like one with unchecked releases
  (tests/fixtures/unchecked/sitecustomize.py): the daemon says so at start-up, serves a
  request and a stream, and drains a stream in flight on SIGTERM.
"""

from __future__ import annotations

import os
import signal

import treq
from twisted.internet.defer import ensureDeferred
from twisted.trial.unittest import TestCase

import crossbar.compat.prometheus as prometheus_fence
import crossbar.compat.twisted as twisted_fence
import crossbar.compat.txredis as txredis_fence
import tests.test_failures as failures
import tests.test_streaming as streaming
from tests.harness import FakeLlama, http_client, listen
from tests.process import ROOT, ClientStream, start_twistd

_UNCHECKED = os.path.join(ROOT, "tests", "fixtures", "unchecked")


def _all_off(case: TestCase) -> None:
    for fence in (twisted_fence, prometheus_fence, txredis_fence):
        case.patch(fence, "FALLBACK", "an unchecked release (tests/test_compat_off.py)")


class StreamingWithTouchpointsOff(streaming.StreamingTests):
    """Streaming, backpressure from a slow client and client disconnects, with Twisted's
    own request writes, buffering and pause signals."""

    def setUp(self) -> None:
        _all_off(self)
        return super().setUp()  # type: ignore[no-any-return]


class FailuresWithTouchpointsOff(failures.HostFailureTests):
    """Rule 7's failures (the stale-connection retry included) on Twisted's own paths."""

    def setUp(self) -> None:
        _all_off(self)
        return super().setUp()  # type: ignore[no-any-return]


class DaemonWithTouchpointsOffTests(TestCase):
    timeout = 90

    def test_a_request_a_stream_and_a_drain(self) -> object:
        async def go() -> None:
            upstream = FakeLlama()
            url = await listen(self, upstream)
            proc = await start_twistd(
                self,
                f"health: {{interval: 60, timeout: 5}}\ndrain: {{delay: 0.2, grace: 20}}\n"
                f"hosts: {{a: '{url}'}}\nroutes: {{r: {{hosts: [a]}}}}\n",
                env={"PYTHONPATH": os.pathsep.join([_UNCHECKED, ROOT])},
            )
            text = proc.text()
            self.assertIn("Twisted 99.1.0 is outside the range", text)
            self.assertIn("prometheus_client 99.1.0 is outside the range", text)
            http = http_client(self)
            response = await http.post(proc.base + "/r/v1/chat/completions", json={"model": "tiny-a"})
            self.assertEqual(response.code, 200)
            await treq.content(response)
            bad = await http.get(proc.base + "/r/%2e%2e/slots")
            self.assertEqual((bad.code, (await treq.json_content(bad))["error"]["message"]), (400, "bad path"))
            stream = ClientStream(http, proc.base + "/r/v1/chat/completions", n=15, delay=0.1)
            await stream.first
            proc.signal("TERM")
            how, body = await stream.done
            self.assertEqual(how, "complete")
            self.assertEqual(ClientStream.events(body), list(range(15)))
            await proc.ended
            self.assertIn(proc.exit, ((0, None), (None, signal.SIGTERM)))  # twistd re-raises SIGTERM

        return ensureDeferred(go())
