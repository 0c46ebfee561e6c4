"""JSON log lines (``twistd --logger crossbar.ops.jsonlog.observer``) and the readable
default text log, through a real twistd process."""

from __future__ import annotations

import io
import json
import random
from datetime import datetime, timezone

import treq
from twisted.internet.defer import ensureDeferred
from twisted.logger import Logger, LogLevel, formatEvent
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase

from crossbar.ops.jsonlog import event_as_line, observer_to
from tests.harness import FakeLlama, http_client, listen
from tests.process import start_twistd

REQUEST_FIELDS = {"route", "host", "method", "path", "status", "bytes", "ttfb_ms", "ms"}


class EventTests(TestCase):
    def test_one_line_with_fields_message_and_failure(self) -> None:
        out = io.StringIO()
        log = Logger(namespace="crossbar.proxy", observer=observer_to(out))
        log.info("{method} {target} -> {host} {status}", method="GET", target="/r/v1/models",
                 host="a", status=200, raw=b"\xff", obj=object(), nested={"k": (1, 2)})
        try:
            1 / 0
        except ZeroDivisionError:
            log.failure("boom on {host}", Failure(), host="b")
        lines = out.getvalue().splitlines()
        self.assertEqual(len(lines), 2)
        first, second = (json.loads(line) for line in lines)
        self.assertEqual(first["message"], "GET /r/v1/models -> a 200")
        self.assertEqual(first["level"], "info")
        self.assertEqual(first["namespace"], "crossbar.proxy")
        self.assertRegex(first["time"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
        self.assertEqual((first["host"], first["status"], first["raw"]), ("a", 200, "\ufffd"))
        self.assertEqual(first["nested"], {"k": [1, 2]})
        self.assertTrue(first["obj"].startswith("<object object"))
        self.assertFalse(any(k.startswith("log_") for k in first))
        self.assertEqual(second["level"], "critical")
        self.assertIn("ZeroDivisionError", second["failure"])

    def test_unformattable_event_still_one_line(self) -> None:
        line = event_as_line({"log_format": "{missing", "log_level": LogLevel.warn, "log_time": 0.0, "x": float("nan")})
        self.assertTrue(line.endswith("\n"))
        self.assertEqual(line.count("\n"), 1)
        doc = json.loads(line)
        self.assertEqual(doc["level"], "warn")


    def test_time_as_datetime_writes_it(self) -> None:
        """The stamp (formatted once per second) is what ``datetime.isoformat`` writes,
        rounding at the millisecond included."""
        rng = random.Random(23)
        stamps = [rng.uniform(0, 2e9) for _ in range(20000)]
        stamps += [1.7e9 + rng.randrange(10**6) / 1e6 - 5e-7 for _ in range(20000)] + [0.0, 1.9999999, 1.9995]
        for when in stamps:
            expected = datetime.fromtimestamp(when, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
            self.assertEqual(json.loads(event_as_line({"log_time": when}))["time"], expected, when)

    def test_message_shortcut_is_format_event(self) -> None:
        """A one-field format with a text value is written without Twisted's formatter;
        every other shape goes through it: the message is the same either way."""
        events = [
            {"log_format": "{line}", "line": "GET / -> a 200 {x}"},
            {"log_format": "{line}", "line": 42},
            {"log_format": "{line}", "line": None},
            {"log_format": "{line}"},
            {"log_format": "{line!r}", "line": "a"},
            {"log_format": "{line:>5}", "line": "a"},
            {"log_format": "{a} {b}", "a": "x", "b": "y"},
            {"log_format": "{a.b}", "a": "x"},
            {"log_format": "plain"},
            {"log_format": None},
            {},
        ]
        for event in events:
            self.assertEqual(json.loads(event_as_line(event))["message"], formatEvent(event), event)

    def test_a_lone_surrogate_does_not_lose_the_line(self) -> None:
        """A host's model id (or any text from outside) with a lone surrogate: the line
        is still written, as valid JSON, to a UTF-8 file."""
        out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
        Logger(namespace="crossbar.health", observer=observer_to(out)).info(
            "host {host} is healthy (models: {models})", host="b", models="\ud800", loaded=["\ud800", "ok"])
        out.flush()
        doc = json.loads(out.buffer.getvalue().decode("utf-8"))  # type: ignore[attr-defined]
        self.assertEqual(doc["loaded"], ["\ud800", "ok"])


class TwistdLogTests(TestCase):
    timeout = 60

    async def _traffic(self, base: str) -> None:
        http = http_client(self)
        response = await http.post(base + "/r/v1/chat/completions?q=1", json={"model": "tiny-a", "messages": []},
                                   headers={"Authorization": "Bearer sk-never-logged"})
        self.assertEqual(response.code, 200)
        await treq.content(response)

    def test_json_lines_through_twistd_logger(self) -> object:
        async def go() -> None:
            url = await listen(self, FakeLlama())
            proc = await start_twistd(self, f"drain: {{delay: 0.2, grace: 1}}\nhosts:\n  a: {url}\nroutes:\n  r:\n    hosts: [a]\n",
                                      logger="crossbar.ops.jsonlog.observer")
            await self._traffic(proc.base)
            await proc.line(lambda line: '"namespace": "crossbar.proxy' in line, 10)
            proc.signal("TERM")
            await proc.ended
            docs = []
            for line in proc.out:
                if line.strip():
                    docs.append(json.loads(line))  # every line is one JSON object
            self.assertTrue(any("twistd" in d["message"] and "starting up" in d["message"] for d in docs))
            (request,) = [d for d in docs if d["namespace"].startswith("crossbar.proxy")]
            self.assertLessEqual(REQUEST_FIELDS, set(request))
            self.assertEqual((request["route"], request["host"], request["method"], request["path"], request["status"]),
                             ("r", "a", "POST", "/v1/chat/completions", 200))
            self.assertGreater(request["bytes"], 0)
            self.assertIsInstance(request["ms"], float)
            self.assertIn("POST /r/v1/chat/completions -> a 200", request["message"])
            self.assertNotIn("sk-never-logged", proc.text())
            self.assertNotIn("Traceback", proc.text())

        return ensureDeferred(go())

    def test_default_text_log_stays_readable(self) -> object:
        async def go() -> None:
            url = await listen(self, FakeLlama())
            proc = await start_twistd(self, f"drain: {{delay: 0.2, grace: 1}}\nhosts:\n  a: {url}\nroutes:\n  r:\n    hosts: [a]\n")
            await self._traffic(proc.base)
            line = await proc.line(lambda line: "[crossbar.proxy#" in line, 10)
            self.assertRegex(line, r"^\d{4}-\d\d-\d\dT\S+ \[crossbar\.proxy\S*#info\] POST /r/v1/chat/completions -> a 200 \d+B ttfb=[\d.]+ms [\d.]+ms \(loaded least-busy affinity=none\)$")
            self.assertFalse(line.lstrip().startswith("{"))
            proc.signal("TERM")
            await proc.ended

        return ensureDeferred(go())
