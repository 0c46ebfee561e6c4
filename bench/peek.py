"""How long the body peek holds the reactor (docs/design.md §"Quality bar": it must not stall the other streams).

    python bench/peek.py [--mib 15] [--chunk 65536] [--rounds 5] [--shapes]

Builds a chat request of about ``--mib`` MiB carrying one base64 image and feeds it to
``crossbar.proxy.peek.BodyPeek`` in ``--chunk``-byte pieces (what ``handleContentChunk`` gets),
timing every ``feed`` and the ``finish``; then times ``json.loads`` of the whole body (what
the proxy did before, in one reactor turn) and both on a small 90-byte chat request (the
per-request cost in bench (a)). Prints medians over rounds. A few seconds at most.
``--shapes`` also times bodies made of many small tokens (what a hostile client can
send), once each, about a minute, with CPU per byte against a plain prompt of the same
size measured in the same run (a hostile body: no shape may cost more than 3x; the
worst was 400,000 ``system`` messages before the first ``user`` message, 12 MiB), and
four shapes where the skipping of values no rule reads (``peek/skip.py``) stops or
looks closer: keys a rule reads nested, at the top level, escaped keys, strings
spelt like keys.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from crossbar.proxy.peek import BodyPeek, backend_name, peek  # noqa: E402


def image_body(mib: float) -> bytes:
    raw = os.urandom(int(mib * 1024 * 1024 * 3 / 4))
    return json.dumps({
        "model": "m1",
        "messages": [
            {"role": "system", "content": "You describe pictures."},
            {"role": "user", "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(raw).decode()}},
            ]},
        ],
        "stream": True,
    }).encode()


def feed_times(body: bytes, chunk: int, check: bool = True) -> tuple[float, float, float, int]:
    """(longest feed s, finish s, total s, feeds) for one pass over ``body``."""
    p = BodyPeek()
    longest, total, feeds = 0.0, 0.0, 0
    for i in range(0, len(body), chunk):
        piece = body[i:i + chunk]
        t = time.perf_counter()
        p.feed(piece)
        spent = time.perf_counter() - t
        longest, total, feeds = max(longest, spent), total + spent, feeds + 1
    t = time.perf_counter()
    answer = p.finish()
    done = time.perf_counter() - t
    assert answer.model == "m1" and (answer.affinity_key is not None or not check), answer
    return longest, done, total + done, feeds


def plain_prompt(mib: float) -> bytes:
    """A completion request whose prompt is ``mib`` MiB of ordinary source text."""
    line = 'the quick brown fox jumps over the lazy dog, then writes:\n\tdef f(x): return "x"\n'
    n = int(mib * 1024 * 1024)
    return json.dumps({"model": "m1", "prompt": (line * (n // len(line) + 1))[:n]}).encode()


def shapes(mib: float) -> dict[str, bytes]:
    n = int(mib * 1024 * 1024)
    return {
        "plain prompt": plain_prompt(mib),
        "system msgs before user": json.dumps({"model": "m1", "messages": [
            {"role": "system", "content": "s"}] * int(400_000 * mib / 15) + [{"role": "user", "content": "go"}]},
            separators=(",", ":")).encode(),
        "ints [0,0,...]": b'{"model":"m1","x":[' + b"0," * (n // 2) + b"0]}",
        "objects [{..},...]": b'{"model":"m1","x":[' + b'{"a":1},' * (n // 8) + b"{}]}",
        "top-level keys": b'{"model":"m1",' + b'"a":{},' * (n // 7) + b'"z":1}',
        "short strings": b'{"model":"m1","x":[' + b'"a",' * (n // 4) + b'"a"]}',
        "text parts (all in the key)": json.dumps({"model": "m1", "messages": [
            {"role": "system", "content": [{"type": "text", "text": "ab"}] * (n // 30)},
            {"role": "user", "content": "x"}]}).encode(),
        # where the skipping stops or looks closer: keys a rule reads, nested and at the top level
        "read keys nested [{user},..]": b'{"model":"m1","x":[' + b'{"user":0},' * (n // 11) + b"{}]}",
        "top-level user keys": b'{"model":"m1",' + b'"user":"a",' * (n // 11) + b'"z":1}',
        "top-level keys, escaped": b'{"model":"m1",' + b'"\u0061":{},' * (n // 12) + b'"z":1}',
        "strings named like keys": b'{"model":"m1","x":[' + b'"user",' * (n // 7) + b'"a"]}',
    }


def per_call(fn: object, arg: bytes, n: int = 20000) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn(arg)  # type: ignore[operator]
    return (time.perf_counter() - t) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=15.0)
    ap.add_argument("--chunk", type=int, default=65536)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", action="store_true", help="also bodies of many small tokens")
    args = ap.parse_args()
    body = image_body(args.mib)
    runs = [feed_times(body, args.chunk) for _ in range(args.rounds)]
    loads = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        json.loads(body)
        loads.append(time.perf_counter() - t)
    small = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}).encode()

    def ms(values: list[float]) -> str:
        return f"{statistics.median(values) * 1e3:.2f} ms [{min(values) * 1e3:.2f}-{max(values) * 1e3:.2f}]"

    print(f"ijson backend {backend_name()}; body {len(body) / 2**20:.1f} MiB in {runs[0][3]} chunks of "
          f"{args.chunk} B; median [min-max] over {args.rounds} rounds")
    print(f"  BodyPeek longest feed      {ms([r[0] for r in runs])}")
    print(f"  BodyPeek finish            {ms([r[1] for r in runs])}")
    print(f"  BodyPeek all feeds, total  {ms([r[2] for r in runs])}")
    print(f"  json.loads(whole body)     {ms(loads)}  (one reactor turn)")
    print(f"small {len(small)} B chat body: peek {per_call(peek, small) * 1e6:.1f} us, "
          f"json.loads {per_call(json.loads, small) * 1e6:.1f} us per call")
    if args.shapes:
        print("many small tokens (one pass each): longest feed / all feeds / json.loads at once; "
              "CPU per byte (process time) and its ratio to the plain prompt")
        plain = 0.0
        for name, body in shapes(args.mib).items():
            cpu = time.process_time()
            longest, _, total, _ = feed_times(body, args.chunk, check=False)
            per_byte = (time.process_time() - cpu) / len(body)
            plain = plain or per_byte
            t = time.perf_counter()
            json.loads(body)
            loads = time.perf_counter() - t
            print(f"  {name:28s} {len(body) / 2**20:4.1f} MiB  {longest * 1e3:6.2f} ms / {total * 1e3:7.1f} ms / "
                  f"{loads * 1e3:6.1f} ms  {per_byte * 1e9:6.1f} ns/B {per_byte / plain:5.1f}x")


if __name__ == "__main__":
    main()
