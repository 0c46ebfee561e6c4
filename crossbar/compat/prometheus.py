"""Every place crossbar touches a private prometheus_client name, fenced in one module.

A request's token counters and generation-speed histogram are updated once per request;
prometheus_client's public ``inc``/``observe`` check their argument, take a lock and
loop over the buckets each time (CPU per request). :func:`adder` and :func:`observer`
do the same update through the children's private parts: ``_value`` (a
``prometheus_client.values.MutexValue`` in one process, the multiprocess file's value
with workers: its ``_file``, ``_key``, ``_value``, ``_timestamp``), ``_upper_bounds``,
``_buckets``, ``_sum`` and ``_is_observable``.

They were checked against prometheus_client 0.20 through 0.26 (:data:`CHECKED`;
``pyproject.toml`` bounds it the same way, ``prometheus_client>=0.20,<0.27``). The
start-up check runs once, at import: :data:`FALLBACK` is None when the installed
version is in that range and the private parts are as expected, else it says why and
both functions hand back the public ``inc``/``observe`` (the library's own behaviour,
slower). ``tests/test_compat_prometheus.py`` names what moved; ``tests/test_metric_adders.py``
checks both paths against the exposition.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any, Callable

from prometheus_client import values

from crossbar.compat import distribution_check, within

__all__ = ["CHECKED", "FALLBACK", "adder", "moved", "observer", "version_checked"]

CHECKED = ((0, 20), (0, 26))
"""The oldest and the newest prometheus_client (major, minor) checked, both included."""


def version_checked(major: int, minor: int) -> bool:
    """Whether prometheus_client ``major.minor`` is within :data:`CHECKED` (as numbers)."""
    return within(CHECKED, major, minor)


def moved() -> list[str]:
    """The private names :func:`adder` and :func:`observer` rely on that are not as
    expected in the installed prometheus_client; empty when all are."""
    from prometheus_client import CollectorRegistry, Counter, Histogram

    found: list[str] = []
    mutex = getattr(values, "MutexValue", None)
    if not isinstance(mutex, type):
        found.append("prometheus_client.values.MutexValue (it is gone)")
    registry = CollectorRegistry()
    counter = Counter("probe", "probe", ["l"], registry=registry).labels("x")
    histogram = Histogram("probe_seconds", "probe", ["l"], buckets=(1.0,), registry=registry).labels("x")
    value = getattr(counter, "_value", None)
    if not callable(getattr(value, "inc", None)) or not isinstance(getattr(value, "_value", None), float):
        found.append("Counter child's _value (no inc, or no float _value)")
    if not callable(getattr(counter, "_is_observable", None)):
        found.append("Counter child's _is_observable (it is gone)")
    bounds, buckets = getattr(histogram, "_upper_bounds", None), getattr(histogram, "_buckets", None)
    if bounds != [1.0, float("inf")] or not isinstance(buckets, list) or len(buckets) != 2:
        found.append("Histogram child's _upper_bounds/_buckets (not a bound and a bucket each, +Inf last)")
    if not callable(getattr(getattr(histogram, "_sum", None), "inc", None)):
        found.append("Histogram child's _sum (no inc)")
    return found



def _file_inc(value: Any) -> Callable[[float], None] | None:
    """For a multiprocess value (workers: ``values.MultiProcessValue``'s ``MmapedValue``,
    its parts ``_file``, ``_key``, ``_value``, ``_timestamp``): its ``inc`` without the
    lock and the ``os.getpid()`` check for a fork (a syscall per call) that each ``inc``
    makes: crossbar updates metrics on the reactor thread only, and a worker is a
    process of its own that never forks. None for any other value."""
    if type(value).__name__ != "MmapedValue" or not isinstance(getattr(value, "_key", None), str) \
            or not isinstance(getattr(value, "_value", None), float) or not hasattr(value, "_timestamp") \
            or not callable(getattr(getattr(value, "_file", None), "write_value", None)):
        return None

    def add(amount: float) -> None:
        value._value = total = value._value + amount
        value._timestamp = 0.0
        value._file.write_value(value._key, total, 0.0)

    return add


def adder(child: Any) -> Callable[[float], None]:
    """``child.inc`` of a labelled counter child, without prometheus_client's per-call
    checks, for amounts crossbar already knows are >= 0 (a request, its tokens): once
    per request, in place of four calls per ``inc``.

    In one process the amount is added to the child's value directly, without its lock:
    crossbar touches its metrics on the reactor thread only (updates and scrapes alike),
    so the lock (~2k instructions per use) guards nothing. With workers the value's own
    ``inc`` writes the shared file (prometheus_client's multiprocess mode). A child
    without the expected parts, or any child under :data:`FALLBACK`, gets its public
    ``inc``."""
    if FALLBACK is not None:
        return child.inc
    value = getattr(child, "_value", None)
    inc = getattr(value, "inc", None)
    if not callable(inc) or not child._is_observable():
        return child.inc
    if type(value) is not values.MutexValue:
        return _file_inc(value) or inc

    def add(amount: float) -> None:
        value._value += amount

    return add


def observer(child: Any) -> Callable[[float], None]:
    """``child.observe`` of a labelled histogram child for finite amounts, without
    prometheus_client's per-call checks and bucket loop: the bucket is found by
    ``bisect`` (the first upper bound >= the amount, as ``observe`` picks it), and the
    sum and that bucket are added to as :func:`adder` adds (in one process, without the
    lock). A child without the expected parts, or any child under :data:`FALLBACK`, gets
    its public ``observe``."""
    if FALLBACK is not None:
        return child.observe
    bounds = getattr(child, "_upper_bounds", None)
    buckets = getattr(child, "_buckets", None)
    total_value = getattr(child, "_sum", None)
    total = getattr(total_value, "inc", None)
    if (not isinstance(bounds, list) or not isinstance(buckets, list) or len(bounds) != len(buckets)
            or not bounds or bounds[-1] != float("inf") or not callable(total) or not child._is_observable()):
        return child.observe
    bounds = list(bounds)
    mutex = values.MutexValue
    if type(total_value) is mutex and all(type(bucket) is mutex for bucket in buckets):
        counts = list(buckets)

        def observe_here(amount: float) -> None:
            total_value._value += amount
            counts[bisect_left(bounds, amount)]._value += 1

        return observe_here
    total = _file_inc(total_value) or total
    incs = [_file_inc(bucket) or bucket.inc for bucket in buckets]

    def observe(amount: float) -> None:
        total(amount)
        incs[bisect_left(bounds, amount)](1)

    return observe


FALLBACK: str | None = distribution_check("prometheus_client", CHECKED, moved)
"""None when :func:`adder` and :func:`observer` may reach into prometheus_client; else
why they hand back its public ``inc``/``observe`` (the start-up check, run at import)."""
