"""Token counts in 10-second buckets, and what status and the dashboard read from them
(docs/design.md §What the answers say: ``status`` per host and route; §Operations: the
dashboard's tokens/s and its 15-minute chart).

One rule for both readers: a :data:`Buckets` mapping (bucket start, POSIX seconds, a
multiple of :data:`BUCKET` -> token cell name
(:func:`~crossbar.state.cells.token_cell`) -> tokens), whoever filled it (this process,
the workers' shared counts or Redis, :class:`~crossbar.state.tokens.TokenLedger`), is
read by :func:`window` (the last minute) and :func:`chart` (tokens/s per host per
bucket), so status and the dashboard cannot disagree on the same buckets.

The last minute is the :data:`WINDOW` seconds before now: every bucket wholly inside
it, the one that is filling included, and of the oldest one it cuts the part inside it
(its tokens taken as spread evenly over its 10 seconds), over :data:`WINDOW` seconds.
Tokens of the last 50 seconds are so counted whole: the figure moves with new tokens,
not with the clock, until they grow old.
"""

from __future__ import annotations

from typing import Mapping

from crossbar.state.cells import token_cell

__all__ = ["BUCKET", "Buckets", "KEEP", "WINDOW", "Window", "bucket_start", "chart", "chart_starts", "window"]

BUCKET = 10
"""Seconds per bucket."""
KEEP = 15 * 60
"""Seconds of buckets kept: the dashboard chart's 15 minutes."""
WINDOW = 60.0
"""Seconds of 'the last minute'."""

Buckets = Mapping[int, Mapping[str, float]]


def bucket_start(at: float) -> int:
    """The start of the bucket holding POSIX second ``at``."""
    return int(at // BUCKET * BUCKET)


class Window:
    """Token counts over the last minute.

    :ivar seconds: the span's length (:data:`WINDOW`).
    :ivar counts: cell name (:func:`~crossbar.state.cells.token_cell`) -> tokens.
    """

    def __init__(self, seconds: float, counts: Mapping[str, float]) -> None:
        self.seconds = seconds
        self.counts = counts

    def _get(self, scope: str, name: str, kind: str) -> float:
        return self.counts.get(token_cell(scope, name, kind), 0.0)

    def generated_per_second(self, host: str) -> float:
        """Tokens ``host`` generated per second over the window, rounded to 2 places
        (what status and the dashboard show)."""
        return round(self._get("h", host, "generated") / self.seconds, 2) if self.seconds > 0 else 0.0

    def cached_share(self, scope: str, name: str) -> float | None:
        """Cached prompt tokens / all prompt tokens of a host (``scope`` "h") or route
        ("r") over the window, rounded to 4 places; None when it read no prompt token."""
        cached = self._get(scope, name, "cached")
        total = cached + self._get(scope, name, "prompt")
        return round(cached / total, 4) if total > 0 else None


def window(buckets: Buckets, now: float) -> Window:
    """The last minute of ``buckets`` at POSIX second ``now`` (see the module doc)."""
    since = now - WINDOW
    counts: dict[str, float] = {}
    for start, cells in buckets.items():
        if start + BUCKET <= since or start > now:
            continue
        weight = 1.0 if start >= since else (start + BUCKET - since) / BUCKET
        for name, n in cells.items():
            counts[name] = counts.get(name, 0.0) + n * weight
    return Window(WINDOW, counts)


def chart_starts(now: float) -> list[int]:
    """The bucket starts the chart shows at ``now``: the last :data:`KEEP` seconds, the
    bucket filling now the last."""
    first = bucket_start(now - KEEP) + BUCKET
    return list(range(first, bucket_start(now) + 1, BUCKET))


def chart(buckets: Buckets, hosts: list[str], now: float) -> dict[str, list[float]]:
    """host -> tokens generated per second in each bucket of :func:`chart_starts`
    (the bucket still filling over the seconds it has had), rounded to 2 places."""
    series: dict[str, list[float]] = {}
    starts = chart_starts(now)
    for host in hosts:
        cell = token_cell("h", host, "generated")
        points = []
        for start in starts:
            span = min(BUCKET, max(1.0, now - start))
            points.append(round(buckets.get(start, {}).get(cell, 0.0) / span, 2))
        series[host] = points
    return series
