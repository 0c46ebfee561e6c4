"""OpenAI's rate-limit headers on a limited key's answers (docs/design.md §Access).

Every answer to a request of a client key with ``limits`` -- relayed from a host or
crossbar's own, 429s included -- carries, for the limits the key has:

- ``requests_per_minute``: ``x-ratelimit-limit-requests`` (the limit),
  ``x-ratelimit-remaining-requests`` (the limit less the requests admitted in the
  sliding minute, this one included) and ``x-ratelimit-reset-requests`` (the time until
  the window is back to its initial state: until the newest admitted request has left
  the minute);
- ``tokens_per_minute``: ``x-ratelimit-limit-tokens``, ``-remaining-tokens`` (less the
  tokens spent in the sliding minute, as the hosts reported them) and ``-reset-tokens``
  (until the newest spending has left the minute); a key with ``tokens_per_day`` and
  no ``tokens_per_minute`` has the ``-tokens`` headers of its UTC day instead (reset:
  the next UTC midnight once anything was spent today).

That is how OpenAI documents them ("the time until the rate limit resets to its initial
state"); durations are written as OpenAI writes them (Go's ``time.Duration``: ``120ms``,
``6s``, ``1.5s``, ``1m0s``, ``1h2m3s``). Nothing is read for a key without limits.

The counts are the ones the limits are checked against (this process's, or with workers
the box's, which with ``cluster.redis`` also count what this box admitted and spent). A
429 of the key's limits always says 0 remaining for some limit: with ``cluster.redis``
the fleet decided it while this box may count less, and a 429 that says every limit has
room would contradict itself. When this box's counts show no limit spent, the first
limit the key has (requests, else tokens) says 0 remaining, reset at its ``Retry-After``.
"""

from __future__ import annotations

import math

from crossbar.config import KeyLimits, Route
from crossbar.state.limits import KeyLimiter

__all__ = ["duration", "key_limit_headers", "rate_limit_headers"]

_ONE_REQUEST = KeyLimits(requests_per_minute=1)
_ONE_TOKEN_MINUTE = KeyLimits(tokens_per_minute=1)
_ONE_TOKEN_DAY = KeyLimits(tokens_per_day=1)


def duration(seconds: float) -> str:
    """``seconds`` written as OpenAI writes a reset (Go's ``time.Duration`` to the
    millisecond, rounded up): ``0s``, ``120ms``, ``6s``, ``6.25s``, ``1m0s``, ``2h0m0s``."""
    ms = max(0, math.ceil(seconds * 1000 - 1e-6))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    whole, frac = divmod(ms, 1000)
    text = f"{whole}.{frac:03d}".rstrip("0") if frac else str(whole)
    if hours:
        return f"{hours}h{minutes}m{text}s"
    if minutes:
        return f"{minutes}m{text}s"
    return f"{text}s"


def rate_limit_headers(limits: KeyLimits, limiter: KeyLimiter, route: str, key: str,
                       refused: float | None = None) -> list[tuple[bytes, bytes]]:
    """The rate-limit headers of ``key`` on ``route`` with ``limits`` now (see the module
    docstring), as (name, value) pairs; none for a key without limits. ``refused``: the
    answer is a 429 of these limits whose ``Retry-After`` is that many seconds."""
    if not limits:
        return []
    counts, now = limiter.counts, limiter.now()
    spent = counts.spent(route, key, now)
    out: list[tuple[bytes, bytes]] = []
    rpm = limits.requests_per_minute
    if rpm is not None:
        used = spent.requests_minute
        out += _three(b"requests", rpm, used, counts.wait(route, key, _ONE_REQUEST, now) if used else 0.0)
    tpm, tpd = limits.tokens_per_minute, limits.tokens_per_day
    if tpm is not None:
        used = spent.tokens_minute
        out += _three(b"tokens", tpm, used, counts.wait(route, key, _ONE_TOKEN_MINUTE, now) if used else 0.0)
    elif tpd is not None:
        used = spent.tokens_day
        out += _three(b"tokens", tpd, used, counts.wait(route, key, _ONE_TOKEN_DAY, now) if used else 0.0)
    if refused is not None and out and not any(n.startswith(b"x-ratelimit-remaining-") and v == b"0" for n, v in out):
        # The fleet refused what this box's counts allow: the first limit says so.
        out[1:3] = [(out[1][0], b"0"), (out[2][0], duration(refused).encode("ascii"))]
    return out


def _three(what: bytes, limit: int, used: int, reset: float) -> list[tuple[bytes, bytes]]:
    return [
        (b"x-ratelimit-limit-" + what, b"%d" % limit),
        (b"x-ratelimit-remaining-" + what, b"%d" % max(0, limit - used)),
        (b"x-ratelimit-reset-" + what, duration(reset).encode("ascii")),
    ]


def key_limit_headers(limiter: KeyLimiter, route: Route | None, key: str,
                      refused: float | None = None) -> list[tuple[bytes, bytes]]:
    """:func:`rate_limit_headers` for a request of ``key`` ("" for none) on ``route``
    (None: no route): none unless the key has ``limits`` there; ``refused`` as there."""
    if not key or route is None:
        return []
    settings = route.keys.get(key)
    if settings is None:
        return []
    limits = settings.limits  # read without KeyLimits.__bool__'s generator: this runs on every keyed answer
    if limits.requests_per_minute is None and limits.tokens_per_minute is None and limits.tokens_per_day is None:
        return []
    return rate_limit_headers(limits, limiter, route.name, key, refused)
