"""The per-request log line (docs/design.md §The proxy, rule 8): one structured event after
each proxied request ends, with its fields; never a body, an Authorization value or the
query string."""

from __future__ import annotations

import json
from typing import Any, cast

from twisted.internet.defer import ensureDeferred
from twisted.logger import ILogObserver, Logger, formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase, TestCase

from crossbar.ops.metrics import Metrics
from crossbar.ops.record import NO_ROUTE, RequestLog, RequestRecord

from tests.harness import two_hosts
from tests.logs import LogCapture
from tests.raw import parse_responses, raw_exchange, request_bytes

SECRET = b"s3cr3t-marker-91ad"


class RequestLogTests(TestCase):
    def test_one_event_per_request_with_fields(self) -> object:
        async def go() -> None:
            log = LogCapture(self)
            hosts = await two_hosts(self)
            body = json.dumps({"model": "model-a", "messages": [{"role": "user", "content": SECRET.decode()}]}).encode()
            data, _ = await raw_exchange(hosts.port, request_bytes(
                b"POST", b"/r/v1/chat/completions?api_key=" + SECRET,
                [(b"Authorization", b"Bearer " + SECRET), (b"Content-Length", b"%d" % len(body)),
                 (b"Cookie", b"sid=" + SECRET)], body))
            [response] = parse_responses(data)
            [event] = log.proxied()
            self.assertEqual(event["route"], "r")
            self.assertEqual(event["host"], "a")
            self.assertEqual(event["method"], "POST")
            self.assertEqual(event["path"], "/v1/chat/completions")
            self.assertEqual(event["status"], 200)
            self.assertEqual(event["bytes"], len(response.body))
            self.assertIsInstance(event["ttfb_ms"], float)
            self.assertIsInstance(event["ms"], float)
            self.assertGreaterEqual(event["ttfb_ms"], 0)
            self.assertGreaterEqual(event["ms"], event["ttfb_ms"])
            self.assertLess(event["ms"], 30000)

            # A streamed answer: logged once, after it ends, with every byte counted.
            stream = b'{"model": "model-b", "stream": true}'
            data, _ = await raw_exchange(hosts.port, request_bytes(
                b"POST", b"/r/v1/chat/completions", [(b"Content-Length", b"%d" % len(stream))], stream))
            [response] = parse_responses(data)
            [_, event] = log.proxied()
            self.assertEqual((event["host"], event["status"], event["bytes"]), ("b", 200, len(response.body)))

            # crossbar's own error answers are logged too, without a host.
            await raw_exchange(hosts.port, request_bytes(b"GET", b"/d/v1/models?token=" + SECRET))
            [_, _, event] = log.proxied()
            self.assertEqual((event["route"], event["status"], event["path"]), ("d", 503, "/v1/models"))
            self.assertEqual(len(log.proxied()), 3)
            log.assert_never_contains(self, SECRET)

        return ensureDeferred(go())

    def test_secret_marker_never_logged_on_failures(self) -> object:
        """Failing requests (413, bad path, a dead host, a client that leaves) log
        nothing of the body, the Authorization value or the query either."""

        async def go() -> None:
            log = LogCapture(self)
            hosts = await two_hosts(self)
            auth = (b"Authorization", b"Bearer " + SECRET)
            await raw_exchange(hosts.port, request_bytes(
                b"POST", b"/r/v1/x?k=" + SECRET, [auth, (b"Content-Length", b"%d" % (17 << 20))], close=False))
            await raw_exchange(hosts.port, request_bytes(b"GET", b"/r/v1/../slots?k=" + SECRET, [auth]))
            with self.assertRaises(AssertionError):  # a client that leaves mid-body
                await raw_exchange(hosts.port, request_bytes(
                    b"POST", b"/r/v1/chat/completions?k=" + SECRET, [auth, (b"Content-Length", b"100")],
                    SECRET), timeout=0.3)
            hosts.service.table.mark_down("a", "test")
            hosts.service.table.mark_down("b", "test")
            await raw_exchange(hosts.port, request_bytes(b"GET", b"/r/v1/models?k=" + SECRET, [auth]))
            self.assertTrue(log.events)
            log.assert_never_contains(self, SECRET)

        return ensureDeferred(go())


class RecordLineTests(SynchronousTestCase):
    """The text of the per-request event (rendered once by RequestLog, issue 14), and the
    metrics it counts, with the label children looked up once per label set."""

    def test_text_and_counts(self) -> None:
        events: list[dict[str, Any]] = []
        observer = cast(ILogObserver, events.append)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        metrics = Metrics()
        log = RequestLog(metrics)
        log.write(RequestRecord("r", "a", "POST", "/v1/{x}", "/r/v1/{x}", 200, 12, 0.0123, ttfb=0.0045,
                                key="k1", why="only"))
        log.write(RequestRecord("r", "a", "POST", "/v1/{x}", "/r/v1/{x}", 200, 3, 0.5, key="k1"))
        log.write(RequestRecord(NO_ROUTE, "", "GET", "/", "/", 404, 0, 0.001))
        texts = [formatEvent(e) for e in events if e.get("log_namespace") == "crossbar.proxy"]
        self.assertEqual(texts, [
            "POST /r/v1/{x} -> a 200 12B ttfb=4.5ms 12.3ms (only) key=k1",
            "POST /r/v1/{x} -> a 200 3B ttfb=- 500.0ms key=k1",
            "GET / -> - 404 0B ttfb=- 1.0ms",
        ])
        first = [e for e in events if e.get("log_namespace") == "crossbar.proxy"][0]
        self.assertEqual((first["route"], first["host"], first["status"], first["ttfb_ms"], first["ms"], first["why"]),
                         ("r", "a", 200, 4.5, 12.3, "only"))
        registry = metrics.registry
        self.assertEqual(registry.get_sample_value(
            "crossbar_requests_total", {"route": "r", "host": "a", "code": "200", "key": "k1", "ended": "complete"}), 2.0)
        self.assertEqual(registry.get_sample_value(
            "crossbar_request_duration_seconds_count", {"route": "r", "host": "a"}), 2.0)
        self.assertEqual(registry.get_sample_value(
            "crossbar_time_to_first_byte_seconds_count", {"route": "r", "host": "a"}), 1.0)
        self.assertEqual(registry.get_sample_value(
            "crossbar_requests_total", {"route": "-", "host": "-", "code": "404", "key": "", "ended": "complete"}), 1.0)

    def test_event_built_as_logger_info_builds_it(self) -> None:
        """The record's event skips ``Logger.emit`` (issue 23) but is the event
        ``Logger.info`` makes: the same ``log_*`` keys and values, to the same observer."""
        events: list[dict[str, Any]] = []
        observer = cast(ILogObserver, events.append)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        RequestLog(Metrics()).write(RequestRecord("r", "a", "POST", "/v1/x", "/r/v1/x", 200, 12, 0.0123))
        [ours] = [e for e in events if e.get("log_namespace") == "crossbar.proxy"]
        legacy = {"format", "message", "isError", "system", "time"}  # added in place by twisted.python.log's bridge
        fields = {k: v for k, v in ours.items() if not k.startswith("log_") and k not in legacy}
        Logger(namespace="crossbar.proxy").info("{line}", **fields)
        theirs = dict(events[-1])
        self.assertEqual(set(ours), set(theirs))
        for key in ("log_level", "log_namespace", "log_source", "log_format"):
            self.assertEqual(ours[key], theirs[key], key)
        self.assertIsInstance(ours["log_logger"], Logger)
        self.assertLess(abs(ours["log_time"] - theirs["log_time"]), 5)
        self.assertEqual(formatEvent(ours), formatEvent(theirs))

    def test_metrics_that_cannot_be_written_lose_no_log_line(self) -> None:
        """With workers, metrics live in files (prometheus_client's multiprocess mode):
        a file that cannot be made (its directory removed under the worker) costs the
        counts, never the log line, and never raises into the proxy."""
        events: list[dict[str, Any]] = []
        observer = cast(ILogObserver, events.append)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)

        class Unwritable:
            def labels(self, *labels: str) -> Any:
                raise FileNotFoundError(2, "No such file or directory", "/tmp/gone/counter_1.db")

        metrics = Metrics()
        metrics.requests = Unwritable()  # type: ignore[assignment]
        log = RequestLog(metrics)
        for _ in range(3):
            log.write(RequestRecord("r", "a", "POST", "/v1/x", "/r/v1/x", 200, 12, 0.01))
        self.assertEqual(len([e for e in events if e.get("log_namespace") == "crossbar.proxy"
                              and e.get("status") == 200]), 3)
        errors = [formatEvent(e) for e in events if "metrics not recorded" in formatEvent(e)]
        self.assertEqual(errors, ["request metrics not recorded (1 so far): [Errno 2] No such file or directory: "
                                  "'/tmp/gone/counter_1.db'"])
