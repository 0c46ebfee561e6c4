#!/usr/bin/env python3
"""Stream one chat completion through crossbar with the real `openai` client.

usage: demo/chat.py PORT [--route demo] [--model tiny-a] [--max-tokens 40]

Prints the tokens as they arrive, then the crossbar host that answered (the
`X-Crossbar-Host` response header) and crossbar's /_crossbar/status JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request

from openai import OpenAI


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("port", type=int)
    ap.add_argument("--route", default="demo")
    ap.add_argument("--model", default="tiny-a")
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--prompt", default="Tell me a short story about a proxy.")
    a = ap.parse_args()

    base = f"http://127.0.0.1:{a.port}"
    client = OpenAI(base_url=f"{base}/{a.route}/v1", api_key="unused", max_retries=0, timeout=60)
    print(f"> {a.prompt}\n", flush=True)
    t0 = time.monotonic()
    first: float | None = None
    n = 0
    with client.chat.completions.with_streaming_response.create(
        model=a.model,
        messages=[{"role": "user", "content": a.prompt}],
        max_tokens=a.max_tokens,
        stream=True,
    ) as response:
        host = response.headers.get("x-crossbar-host", "(no X-Crossbar-Host header)")
        for chunk in response.parse():
            for choice in chunk.choices:
                text = choice.delta.content
                if text:
                    if first is None:
                        first = time.monotonic() - t0
                    n += 1
                    sys.stdout.write(text)
                    sys.stdout.flush()
    total = time.monotonic() - t0
    print(f"\n\n[{n} chunks, first after {1000 * (first or total):.0f} ms, total {1000 * total:.0f} ms]")
    print(f"answered by host: {host}")

    with urllib.request.urlopen(f"{base}/_crossbar/status", timeout=10) as resp:
        status = json.load(resp)
    print("/_crossbar/status:")
    print(json.dumps(status, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
