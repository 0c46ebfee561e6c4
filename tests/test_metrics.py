"""Prometheus metrics at /_crossbar/metrics (docs/design.md §Operations), after real traffic
through an in-process crossbar on loopback sockets, parsed with prometheus_client."""

from __future__ import annotations

import treq
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.trial.unittest import TestCase
from twisted.web.server import Site

from tests.harness import FakeLlama, http_client, listen, start_crossbar
from tests.process import ClientStream


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


class MetricsTests(TestCase):
    def test_names_labels_and_values_after_traffic(self) -> object:
        async def go() -> None:
            good = FakeLlama(models=["tiny-a", "tiny-b"])
            url_a = await listen(self, good)
            doomed_site = Site(FakeLlama())
            doomed_site.noisy = False
            doomed = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(doomed_site)
            url_b = f"http://127.0.0.1:{doomed.getHost().port}"
            service, base = await start_crossbar(self, f"""
health: {{interval: 60, timeout: 2}}
hosts:
  a: {url_a}
  b: {url_b}
routes:
  r:
    hosts: [b, a]
""")
            await service.poller.when_first_round_done()
            await doomed.stopListening()  # b was healthy; its next connection is refused
            http = http_client(self)
            target = base + "/r/v1/chat/completions"
            for _ in range(2):
                how, _body = await ClientStream(http, target, n=3, delay=0.01).done
                self.assertEqual(how, "complete")
            bad = await http.get(base + "/r/v1/nope-but-allowed")
            await treq.content(bad)  # relayed 404 from a
            open_stream = ClientStream(http, target, n=30, delay=0.05)
            self.addCleanup(lambda: open_stream.done)
            await open_stream.first

            response = await http.get(base + "/_crossbar/metrics")
            self.assertEqual(response.code, 200)
            self.assertTrue(response.headers.getRawHeaders(b"content-type")[0].startswith(b"text/plain; version="))
            text = (await treq.content(response)).decode()
            s = _samples(text)
            self.assertEqual(s[("crossbar_requests_total", (("code", "200"), ("ended", "complete"), ("host", "a"), ("key", ""), ("route", "r")))], 2)
            self.assertEqual(s[("crossbar_requests_total", (("code", "404"), ("ended", "complete"), ("host", "a"), ("key", ""), ("route", "r")))], 1)
            self.assertEqual(s[("crossbar_request_duration_seconds_count", (("host", "a"), ("route", "r")))], 3)
            self.assertGreater(s[("crossbar_request_duration_seconds_sum", (("host", "a"), ("route", "r")))], 0.02)
            self.assertEqual(s[("crossbar_time_to_first_byte_seconds_count", (("host", "a"), ("route", "r")))], 3)
            self.assertIn(("crossbar_time_to_first_byte_seconds_bucket", (("host", "a"), ("le", "+Inf"), ("route", "r"))), s)
            self.assertEqual(s[("crossbar_inflight_requests", (("host", "a"), ("route", "r")))], 1)
            self.assertEqual(s[("crossbar_inflight_requests", (("host", "b"), ("route", "r")))], 0)
            self.assertEqual(s[("crossbar_host_healthy", (("host", "a"),))], 1)
            self.assertEqual(s[("crossbar_host_healthy", (("host", "b"),))], 0)
            self.assertEqual(s[("crossbar_host_models_loaded", (("host", "a"),))], 2)
            self.assertEqual(s[("crossbar_mark_downs_total", (("host", "b"), ("reason", "connect")))], 1)
            self.assertGreaterEqual(s[("crossbar_poll_duration_seconds_count", (("host", "a"), ("result", "ok")))], 1)
            # Conventions: counters end in _total, histograms are durations in _seconds
            # or speeds in _per_second (tokens/s).
            for family in text_string_to_metric_families(text):
                self.assertTrue(family.name.startswith("crossbar_"), family.name)
                if family.type == "histogram":
                    self.assertTrue(family.name.endswith(("_seconds", "_per_second")), family.name)

            self.assertEqual((await open_stream.done)[0], "complete")

        return ensureDeferred(go())
