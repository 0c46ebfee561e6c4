"""What reading an answer's figures costs per request, in-process.

    python bench/figures_ab.py [--pairs 8000] [--runs 3] [--answer bench|llama|sse|all] [--steps]

DESIGN's target for the figures (tokens, speed, cache read from every answer) is at most
+10 us CPU per request against the same run without them. Through a real crossbar and
wrk that is far below the noise of a shared machine (bench/HISTORY.md), so this script
times exactly the per-request work the figures add, in one process:

- **off**: one request's relay of an answer with this checkout's code -- a
  :class:`~crossbar.proxy.relay.Relay` started on a response, the answer's body (one
  chunk; ``sse``: 800-byte chunks), a clean end -- then a
  :class:`~crossbar.ops.record.RequestRecord` without figures written by a
  :class:`~crossbar.ops.record.RequestLog` without a token ledger (the log line to
  twistd's text log observer on ``/dev/null``, the request metrics);
- **on**: the same, plus ``Relay.figures`` (the reader), the record with its figures,
  model label and ending, and a ``RequestLog`` with the service's
  :class:`~crossbar.state.tokens.TokenLedger` (the token counters, the speed histogram,
  the ledger, the log line's figures).

"off" is the equivalent path with the reader not called, not the commit before the
figures landed (01e454f): the relay has gained the client stall and the host's sign of
life since, which such an A/B would charge to the figures. What stays in "off" of the
figures is the per-chunk keeping of the tail (a per-event cost, target +1 us, met) and
a few ``is None`` checks.

Method: off and on alternate request by request (off-on, on-off, ...), each request
timed on its own with ``time.process_time_ns`` (this process's CPU: time other
processes take is not counted, but on a busy machine they still slow the caches, so
single requests vary by 2x). With ``--pairs`` pairs per run the report gives per request
the median and the 10th percentile (the least disturbed requests: the steadiest figure
on a shared machine) of each side and their differences; ``--runs`` repeats that.
Garbage collection runs between blocks of 500 pairs, never inside a timed request.
``--steps`` times the figures' parts the same way, added one at a time: the reader
(``Relay.figures``), the record's four fields, the figures counted and logged, the
ledger.

Answers (``--answer``): ``bench``: bench/upstream.py's 271-byte chat completion with
``usage`` (what bench (a) relays); ``llama``: a llama-server chat completion with
``usage`` and ``timings`` (what real hosts send); ``sse``: the tail of a llama-server
stream (20 events in 800-byte chunks, the last event with ``usage`` and ``timings``).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # for bench/upstream.py

from twisted.internet.task import Clock  # noqa: E402
from twisted.logger import globalLogBeginner, textFileLogObserver  # noqa: E402
from twisted.python.failure import Failure  # noqa: E402
from twisted.web.client import ResponseDone  # noqa: E402
from twisted.web.http_headers import Headers  # noqa: E402

from crossbar.ops.metrics import Metrics  # noqa: E402
from crossbar.ops.record import RequestLog, RequestRecord  # noqa: E402
from crossbar.proxy.relay import Relay  # noqa: E402
from crossbar.state.tokens import TokenLedger  # noqa: E402
from upstream import _COMPLETION  # noqa: E402  (bench/upstream.py)

PATH = b"/v1/chat/completions"

_BENCH = _COMPLETION  # what bench (a) relays

_TIMINGS = {"cache_n": 1800, "prompt_n": 57, "prompt_ms": 41.2, "prompt_per_token_ms": 0.72,
            "prompt_per_second": 1383.4, "predicted_n": 64, "predicted_ms": 902.5,
            "predicted_per_token_ms": 14.1, "predicted_per_second": 70.91}
_LLAMA = json.dumps(
    {
        "choices": [{"finish_reason": "length", "index": 0,
                     "message": {"role": "assistant", "content": "Sure. Here is a short answer " * 8}}],
        "created": 1764633600, "model": "qwen2.5-0.5b-instruct", "system_fingerprint": "b7100-1a2b3c4d",
        "object": "chat.completion",
        "usage": {"completion_tokens": 64, "prompt_tokens": 1857, "total_tokens": 1921,
                  "prompt_tokens_details": {"cached_tokens": 1800}},
        "id": "chatcmpl-Xq2pY7", "timings": _TIMINGS,
    },
    separators=(",", ":"),
).encode()
_EVENT = (b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" word"}}],"created":1764633600,'
          b'"id":"chatcmpl-Xq2pY7","model":"qwen2.5-0.5b-instruct","system_fingerprint":"b7100-1a2b3c4d",'
          b'"object":"chat.completion.chunk"}\n\n')
_SSE = _EVENT * 19 + b"data: " + json.dumps(
    {"choices": [{"finish_reason": "stop", "index": 0, "delta": {}}], "created": 1764633600,
     "id": "chatcmpl-Xq2pY7", "model": "qwen2.5-0.5b-instruct", "object": "chat.completion.chunk",
     "usage": {"completion_tokens": 20, "prompt_tokens": 1857, "total_tokens": 1877},
     "timings": _TIMINGS}, separators=(",", ":")).encode() + b"\n\ndata: [DONE]\n\n"

ANSWERS: dict[str, tuple[bytes, bytes, bool]] = {
    "bench": (_BENCH, b"application/json", False),
    "llama": (_LLAMA, b"application/json; charset=utf-8", False),
    "sse": (_SSE, b"text/event-stream", True),
}
"""name -> (body, content type, streamed)."""


class _Channel:
    _waitingForTransport = False
    transport = None


class _Request:
    """The client side of a relay: what :class:`Relay` calls on it, nothing more (the
    same in both modes)."""

    channel = _Channel()

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        pass

    def unregisterProducer(self) -> None:
        pass

    def write(self, data: bytes) -> None:
        pass


class _Transport:
    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


class _Response:
    """An upstream response: its headers, length and body hand-over."""

    def __init__(self, content_type: bytes, length: int | None) -> None:
        self.headers = Headers({b"content-type": [content_type], b"server": [b"llama.cpp"]})
        self.length = length
        self.code = 200

    def deliverBody(self, protocol: Any) -> None:
        protocol.makeConnection(_Transport())


_DONE = Failure(ResponseDone())


STEPS = ("off", "+ Relay.figures (the reader)", "+ the record's four fields", "+ figures counted and logged",
         "+ the ledger (= on)")


def request_work(answer: str, step: int) -> Callable[[], None]:
    """One request's relay + record write as a closure: ``step`` 0 is "off", 4 is "on",
    1-3 add the parts of :data:`STEPS` one at a time."""
    body, ctype, streamed = ANSWERS[answer]
    chunks = [body[i:i + 800] for i in range(0, len(body), 800)] if streamed else [body]
    clock = Clock()
    seen: dict[str, float] = {}
    metrics = Metrics()
    ledger = TokenLedger(time.time, ("gpu-a",), ("chat",)) if step >= 4 else None  # reactor.seconds
    log = RequestLog(metrics, ledger)
    request = _Request()
    response = _Response(ctype, None if streamed else len(body))
    rest = PATH
    ttft = 0.0421 if streamed else None

    def once() -> None:
        relay = Relay(request, clock, 120.0, 60.0, "gpu-a", seen, ctype)  # type: ignore[arg-type]
        relay.start(response)  # type: ignore[arg-type]
        for chunk in chunks:
            relay.dataReceived(chunk)
        relay.connectionLost(_DONE)
        if step >= 2:
            figures = relay.figures(rest)
            record = RequestRecord(
                route="chat", host="gpu-a", method="POST", path="/v1/chat/completions",
                target="/chat/v1/chat/completions", status=200, bytes=relay.bytes, duration=0.125,
                ttfb=0.0421, queued=0.0, key="", why="loaded least-busy affinity=none",
                ended="complete", figures=figures if step >= 3 else None, model="bench", ttft=ttft,
            )
        else:
            if step == 1:
                relay.figures(rest)
            record = RequestRecord(
                route="chat", host="gpu-a", method="POST", path="/v1/chat/completions",
                target="/chat/v1/chat/completions", status=200, bytes=relay.bytes, duration=0.125,
                ttfb=0.0421, queued=0.0, key="", why="loaded least-busy affinity=none",
            )
        log.write(record)

    return once


def timed(works: list[Callable[[], None]], pairs: int) -> list[list[float]]:
    """Per work, the CPU microseconds of each of ``pairs`` requests, the works taking
    turns request by request (forwards, then backwards)."""
    clock = time.process_time_ns
    for work in works:  # warm-up: every label child made, every cache filled
        for _ in range(300):
            work()
    out: list[list[float]] = [[] for _ in works]
    forwards = list(enumerate(works))
    backwards = forwards[::-1]
    gc.collect()
    gc.disable()
    try:
        for i in range(pairs):
            for k, work in (forwards if i & 1 else backwards):
                t0 = clock()
                work()
                out[k].append((clock() - t0) / 1e3)
            if i % 500 == 499:
                gc.enable()
                gc.collect()
                gc.disable()
    finally:
        gc.enable()
    return out


def p10(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[0]


def ab(answer: str, pairs: int, runs: int) -> dict[str, Any]:
    """Off against on, ``runs`` times; prints and returns the figures."""
    print(f"[{answer}] {len(ANSWERS[answer][0])}-byte answer, {runs} runs x {pairs} pairs, us CPU per request")
    print("  run   off median / p10    on median / p10    added median / p10")
    rows = []
    for run in range(runs):
        off, on = timed([request_work(answer, 0), request_work(answer, 4)], pairs)
        row = {"off_median": statistics.median(off), "off_p10": p10(off),
               "on_median": statistics.median(on), "on_p10": p10(on)}
        row["added_median"] = row["on_median"] - row["off_median"]
        row["added_p10"] = row["on_p10"] - row["off_p10"]
        rows.append(row)
        print(f"  {run + 1:3d}   {row['off_median']:6.1f} / {row['off_p10']:5.1f}     "
              f"{row['on_median']:6.1f} / {row['on_p10']:5.1f}     {row['added_median']:+5.1f} / {row['added_p10']:+5.1f}")
    return {"answer": answer, "runs": rows}


def steps(answer: str, pairs: int) -> None:
    """The parts of "on", added one at a time (10th percentiles)."""
    results = timed([request_work(answer, step) for step in range(len(STEPS))], pairs)
    tenths = [p10(r) for r in results]
    print(f"[{answer}] the parts, us CPU per request (10th percentile; the step's own cost):")
    for k, name in enumerate(STEPS):
        extra = "" if k == 0 else f"  {tenths[k] - tenths[k - 1]:+5.1f}  (on - off so far {tenths[k] - tenths[0]:+5.1f})"
        print(f"  {name:34s} {tenths[k]:6.1f}{extra}")


def instructions(answer: str, low: int, high: int) -> list[float]:
    """Per step of :data:`STEPS`, the machine instructions one request executes, counted by
    valgrind's cachegrind (``I refs``) for ``high`` and for ``low`` requests in a fresh
    process each (the difference over ``high - low``: start-up and warm-up cancel out).
    Load on the machine does not change these counts."""
    out = []
    for step in range(len(STEPS)):
        counts = []
        for n in (low, high):
            with tempfile.TemporaryDirectory() as tmp:
                run = subprocess.run(
                    ["valgrind", "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={tmp}/cg.out",
                     sys.executable, __file__, "--count", answer, str(step), str(n)],
                    capture_output=True, text=True, check=True)
            found = re.search(r"I\s+refs:\s+([\d,]+)", run.stderr)
            assert found is not None, run.stderr[-2000:]
            counts.append(int(found.group(1).replace(",", "")))
        out.append((counts[1] - counts[0]) / (high - low))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=8000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--answer", choices=sorted(ANSWERS) + ["all"], default="bench")
    ap.add_argument("--steps", action="store_true", help="also time the parts of 'on', added one at a time")
    ap.add_argument("--instructions", action="store_true",
                    help="instead: instructions per request of each step, counted by valgrind (slow, load-proof)")
    ap.add_argument("--count", nargs=3, metavar=("ANSWER", "STEP", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write the runs' figures to this file")
    a = ap.parse_args()
    if a.count:  # one process of --instructions: N requests of one step
        sink = open(os.devnull, "w")
        globalLogBeginner.beginLoggingTo([textFileLogObserver(sink)], discardBuffer=True, redirectStandardIO=False)
        work = request_work(a.count[0], int(a.count[1]))
        for _ in range(int(a.count[2])):
            work()
        return
    if a.instructions:
        for answer in (sorted(ANSWERS) if a.answer == "all" else [a.answer]):
            per = instructions(answer, 300, 1300)
            print(f"[{answer}] instructions per request (valgrind, 1300 - 300 requests):")
            for k, name in enumerate(STEPS):
                extra = "" if k == 0 else (f"  {per[k] - per[k - 1]:+8.0f}  (on - off so far {per[k] - per[0]:+7.0f}, "
                                           f"{(per[k] - per[0]) / per[0]:+.1%})")
                print(f"  {name:34s} {per[k]:9.0f}{extra}")
        return
    sink = open(os.devnull, "w")
    globalLogBeginner.beginLoggingTo([textFileLogObserver(sink)], discardBuffer=True, redirectStandardIO=False)
    load = os.getloadavg
    print(f"load average {load()[0]:.2f} {load()[1]:.2f} {load()[2]:.2f}; {sys.implementation.name} "
          f"{sys.version.split()[0]}; {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    results = []
    for answer in (sorted(ANSWERS) if a.answer == "all" else [a.answer]):
        results.append(ab(answer, a.pairs, a.runs))
        if a.steps:
            steps(answer, a.pairs)
    print(f"load average {load()[0]:.2f} {load()[1]:.2f} {load()[2]:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
