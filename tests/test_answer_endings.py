"""How an answer ended, in the log and the metrics, and the 503s' ``Retry-After``
(docs/design.md §The proxy, rules 8 and 10; issue 20 item 10). Real loopback sockets."""

from __future__ import annotations

import json
from typing import Any

import treq
from twisted.internet.defer import ensureDeferred
from twisted.trial.unittest import TestCase
from twisted.web.server import NOT_DONE_YET, Request

from tests.harness import FakeLlama, http_client, listen, sse_event, start_routes, two_hosts, wait_for
from tests.logs import LogCapture
from tests.raw import connect_raw, post_bytes
from tests.upstreams import Die


def _done_but_open(request: Request, body: bytes) -> Any:
    """A stream whose last event (``[DONE]``) is sent but whose end is not (yet)."""
    request.setHeader(b"content-type", b"text/event-stream")
    for i in range(3):
        request.write(sse_event(i))
    request.write(b"data: [DONE]\n\n")
    return NOT_DONE_YET


def _three_events(request: Request, body: bytes) -> Any:
    """A stream that sends three events and then nothing more."""
    request.setHeader(b"content-type", b"text/event-stream")
    for i in range(3):
        request.write(sse_event(i))
    return NOT_DONE_YET


async def requests_total(case: TestCase, base: str) -> dict[tuple[str, str], float]:
    """``crossbar_requests_total`` of route ``r``, host ``a`` as scraped: (code, ended) ->
    count (a series without ``ended`` counts under "")."""
    from prometheus_client.parser import text_string_to_metric_families

    text = await treq.text_content(await http_client(case).get(base + "/_crossbar/metrics"))
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "crossbar_requests_total" and (labels["route"], labels["host"]) == ("r", "a"):
                key = (labels["code"], labels.get("ended", ""))
                out[key] = out.get(key, 0) + sample.value
    return out


class EndingTests(TestCase):
    def test_client_leaving_after_done_is_complete(self) -> object:
        """The client read ``[DONE]`` and closed before the host's end reached crossbar:
        the answer was complete (200, ended complete), not 499."""

        async def go() -> None:
            watch = LogCapture(self)
            upstream = FakeLlama()
            upstream.handlers[b"/v1/chat/completions"] = _done_but_open
            upstream.handlers[b"/v1/completions"] = _three_events
            _, base = await start_routes(self, {"a": await listen(self, upstream)})
            body = json.dumps({"stream": True}).encode()
            client = await connect_raw(self, base, post_bytes(b"/r/v1/chat/completions", body))
            await client.wait_for(b"data: [DONE]\n\n")
            client.transport.loseConnection()  # type: ignore[union-attr]
            [event] = await wait_for(lambda: watch.proxied(), what="the log line")
            self.assertEqual((event["status"], event["ended"]), (200, "complete"))
            self.assertNotIn("ended=", event["line"])

            # One that leaves before the last event is gone (499).
            client = await connect_raw(self, base, post_bytes(b"/r/v1/completions", body))
            await client.wait_for(b'"i": 2')
            client.transport.loseConnection()  # type: ignore[union-attr]
            await wait_for(lambda: len(watch.proxied()) == 2, what="the second log line")
            event = watch.proxied()[1]
            self.assertEqual((event["status"], event["ended"]), (499, "client_gone"))
            self.assertIn("ended=client_gone", event["line"])
            self.assertEqual(watch.errors(), [])
            # crossbar_requests_total says how each ended beside its code (rule 8)
            counted = await requests_total(self, base)
            self.assertEqual(counted, {("200", "complete"): 1, ("499", "client_gone"): 1})

        return ensureDeferred(go())

    def test_cut_answer_is_logged_and_counted_cut(self) -> object:
        """A host that dies mid-answer: the log line says ended=cut and the metrics count
        it in ``crossbar_unfinished_answers_total``."""

        async def go() -> None:
            watch = LogCapture(self)
            upstream = FakeLlama()
            upstream.handlers[b"/v1/chat/completions"] = Die(events=2)
            _, base = await start_routes(self, {"a": await listen(self, upstream)})
            client = await connect_raw(self, base, post_bytes(b"/r/v1/chat/completions", b'{"stream": true}'))
            await client.closed
            [event] = await wait_for(lambda: watch.proxied(), what="the log line")
            self.assertEqual(event["ended"], "cut")
            self.assertIn("ended=cut", event["line"])
            metrics = await treq.text_content(await http_client(self).get(base + "/_crossbar/metrics"))
            self.assertIn('crossbar_unfinished_answers_total{ended="cut",host="a",route="r"} 1.0', metrics)
            # not a plain 200: the request counter carries ended="cut" beside the code (rule 8)
            self.assertEqual(await requests_total(self, base), {("200", "cut"): 1})

        return ensureDeferred(go())


class RetryAfterTests(TestCase):
    def test_every_503_carries_retry_after(self) -> object:
        """``no healthy host`` (a request and the model list) carries ``Retry-After`` like
        the busy answers, so clients' retries back off."""

        async def go() -> None:
            hosts = await two_hosts(self)
            client = http_client(self)
            for response in (await client.post(hosts.base + "/d/v1/chat/completions", json={"model": "x"}),
                             await client.get(hosts.base + "/d/v1/models")):
                self.assertEqual(response.code, 503)
                self.assertEqual(await treq.json_content(response), {"error": {"code": 503, "message": "no healthy host", "type": "unavailable_error"}})
                self.assertEqual(response.headers.getRawHeaders(b"retry-after"), [b"1"])

        return ensureDeferred(go())
