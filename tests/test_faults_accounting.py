"""Issue 11 item 6: every answer crossbar gives is logged once and counted
(docs/design.md §The proxy, rule 8) -- the 413 for a body over the limit, the 400 for a
request Twisted cannot parse, and crossbar's own JSON errors -- with the body bytes the
client really received, and the route label of the configured route where one
applies, else ``-``."""

from __future__ import annotations

from typing import Any

import treq
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.defer import ensureDeferred
from twisted.trial.unittest import TestCase

from crossbar.proxy.request import MAX_BODY
from tests.harness import TwoHosts, http_client, two_hosts, wait_for
from tests.logs import LogCapture
from tests.raw import parse_responses, raw_exchange, request_bytes


async def _requests_total(case: TestCase, base: str) -> dict[tuple[str, str, str], float]:
    """``crossbar_requests_total`` as scraped: (route, host, code) -> count."""
    response = await http_client(case).get(base + "/_crossbar/metrics")
    text = (await treq.content(response)).decode()
    out: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "crossbar_requests_total":
                labels = sample.labels
                key = (labels["route"], labels["host"], labels["code"])
                out[key] = out.get(key, 0.0) + sample.value  # summed over `ended`
    return out


class AccountingTests(TestCase):
    timeout = 30

    async def _check(
        self, hosts: TwoHosts, watch: LogCapture, request: bytes, status: int, route: str, method: str,
        target: str,
    ) -> None:
        """Send ``request``; the answer is ``status``; exactly one proxy log event
        with that status, ``route``, ``method``, ``target`` and the body bytes the
        client got; one more count for (``route``, ``-``, ``status``)."""
        key = (route, "-", str(status))
        before = (await _requests_total(self, hosts.base)).get(key, 0.0)
        logged = len(watch.proxied())
        data, _ = await raw_exchange(hosts.port, request)
        [answer] = parse_responses(data)
        self.assertEqual(answer.status, status, data)
        self.assertGreater(len(answer.body), 0, "crossbar's answers carry a JSON body")
        await wait_for(lambda: len(watch.proxied()) > logged, 2.0, "the answer's log event")
        events: list[dict[str, Any]] = watch.proxied()[logged:]
        self.assertEqual(len(events), 1, events)
        [event] = events
        self.assertEqual(
            (event["status"], event["bytes"], event["route"], event["method"], event["target"]),
            (status, len(answer.body), route, method, target),
        )
        after = await _requests_total(self, hosts.base)
        self.assertEqual(after.get(key, 0.0), before + 1, after)
        self.assertEqual(len(watch.proxied()), logged + 1, "a second log event came later")

    def test_413_over_the_body_limit(self) -> object:
        async def go() -> None:
            watch = LogCapture(self)
            hosts = await two_hosts(self)
            head = request_bytes(b"POST", b"/r/v1/chat/completions", [(b"Content-Length", b"%d" % (MAX_BODY + 1))])
            await self._check(hosts, watch, head, 413, "r", "POST", "/r/v1/chat/completions")

        return ensureDeferred(go())

    def test_400_for_a_bad_request_line(self) -> object:
        async def go() -> None:
            watch = LogCapture(self)
            hosts = await two_hosts(self)
            await self._check(hosts, watch, b"NOT A REQUEST LINE AT ALL\r\n\r\n", 400, "-", "NOT", "A")

        return ensureDeferred(go())

    def test_400_for_a_bad_header(self) -> object:
        async def go() -> None:
            watch = LogCapture(self)
            hosts = await two_hosts(self)
            bad = b"GET /r/v1/models HTTP/1.1\r\nHost: crossbar.test\r\nno colon here\r\n\r\n"
            # recorded with the route and target its request line named
            await self._check(hosts, watch, bad, 400, "r", "GET", "/r/v1/models")

        return ensureDeferred(go())

    def test_404_unknown_route(self) -> object:
        async def go() -> None:
            watch = LogCapture(self)
            hosts = await two_hosts(self)
            await self._check(hosts, watch, request_bytes(b"GET", b"/nope/v1/models"), 404, "-", "GET", "/nope/v1/models")

        return ensureDeferred(go())

    def test_503_no_healthy_host(self) -> object:
        async def go() -> None:
            watch = LogCapture(self)
            hosts = await two_hosts(self)
            await self._check(hosts, watch, request_bytes(b"GET", b"/d/v1/models"), 503, "d", "GET", "/d/v1/models")

        return ensureDeferred(go())
