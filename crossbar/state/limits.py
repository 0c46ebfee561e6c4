"""A client key's limits (docs/design.md §Access): requests and tokens per minute, tokens per
UTC day, checked when a request arrives.

:class:`KeyLimiter` keeps what each (route, key) has been admitted and has spent: a
sliding 60 s window of admitted requests and of spent tokens, and the tokens of the
current UTC day. A request is refused while the key is at ``requests_per_minute``, or
has already spent ``tokens_per_minute`` in the last 60 s or ``tokens_per_day`` today;
the refusal says in how many seconds the window allows the next one (the
``Retry-After``).

Alone (``workers: 1``) the counts are this process's (:class:`ProcessCounts`, exact
times). With ``workers: N`` they are the box's: every worker counts into its row of
shared memory and checks the sum of every row
(:class:`~crossbar.state.box_limits.BoxLimits`), so the limits hold per box (two
workers admitting the last request at the same moment may exceed a limit by at most
N - 1, as with ``max_inflight``).

With ``cluster.redis`` (:class:`RedisLimits`) the same check runs in Redis, in one Lua
script over counters every instance shares (a sorted set of admitted requests, per-
second buckets of tokens, a counter per UTC day), so the limits hold fleet-wide. The
check waits for Redis at most :data:`~crossbar.state.cluster.BOUND`; a Redis that is
down or slow leaves the decision to the local counts (this process's, or the box's,
which are always kept, for that). A single check over the bound is counted and logged
(:meth:`~crossbar.state.cluster.SlowChecks.note`). What was admitted and spent
while Redis did not hear of it is kept (:class:`RedisLimits`' backlog) and written to
Redis when the instance rejoins, so the fleet's windows count it: an outage does not
make a key's limits forget.

Tokens are reported by :meth:`KeyLimiter.spend` when an answer ends (the token figures
of §"What the answers say").
"""

from __future__ import annotations

import calendar
import itertools
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
import txredisapi
from twisted.internet.defer import Deferred, succeed
from twisted.python.failure import Failure
from zope.interface import Interface, implementer

from crossbar.config import KeyLimits

if TYPE_CHECKING:
    from crossbar.state.cluster import RedisCluster

__all__ = [
    "MINUTE", "ILimitCounts", "KeyLimiter", "LimitsCollector", "ProcessCounts", "RedisLimits", "Spending",
    "retry_after_header", "to_midnight", "utc_day",
]

MINUTE = 60.0
_DAY = 86400


def utc_day(now: float) -> int:
    """The UTC day number of POSIX seconds ``now``."""
    return int(now // _DAY)


def to_midnight(now: float) -> float:
    """Seconds from ``now`` to the next UTC midnight."""
    return (utc_day(now) + 1) * _DAY - now


def retry_after_header(seconds: float) -> int:
    """The whole seconds a ``Retry-After`` says for a wait of ``seconds`` (at least 1)."""
    return max(1, math.ceil(seconds - 1e-9))


@dataclass(frozen=True)
class Spending:
    """What one key has been admitted and has spent (status and metrics).

    :ivar requests_minute: requests admitted in the last 60 s.
    :ivar tokens_minute: tokens spent in the last 60 s.
    :ivar tokens_day: tokens spent this UTC day.
    """

    requests_minute: int
    tokens_minute: int
    tokens_day: int


class ILimitCounts(Interface):
    """Where a :class:`KeyLimiter` keeps what each (route, key) was admitted and spent:
    :class:`ProcessCounts` (this process alone), or with workers
    :class:`~crossbar.state.box_limits.BoxLimits` (every worker of the box)."""

    def wait(route: str, key: str, limits: KeyLimits, now: float) -> float:
        """Seconds from POSIX time ``now`` until the counts allow a request of ``key`` (0: now)."""

    def admit(route: str, key: str, now: float) -> None:
        """Count one request of ``key`` admitted at ``now``."""

    def spend(route: str, key: str, tokens: int, now: float) -> None:
        """Count ``tokens`` spent by ``key`` at ``now``."""

    def spending(now: float) -> dict[tuple[str, str], Spending]:
        """(route, key) -> what was admitted and spent in the windows around ``now``."""

    def spent(route: str, key: str, now: float) -> Spending:
        """What (route, key) was admitted and spent in the windows around ``now``
        (read only; all 0 for a key never counted)."""


class _Window:
    """One (route, key)'s counts in this process."""

    __slots__ = ("requests", "tokens", "tokens_sum", "day", "day_tokens")

    def __init__(self) -> None:
        self.requests: deque[float] = deque()
        self.tokens: deque[tuple[float, int]] = deque()
        self.tokens_sum = 0
        self.day = 0
        self.day_tokens = 0

    def trim(self, now: float) -> None:
        edge = now - MINUTE
        while self.requests and self.requests[0] <= edge:
            self.requests.popleft()
        while self.tokens and self.tokens[0][0] <= edge:
            self.tokens_sum -= self.tokens.popleft()[1]
        if self.day != utc_day(now):
            self.day, self.day_tokens = utc_day(now), 0


@implementer(ILimitCounts)
class ProcessCounts:
    """The counts of one process: the exact times of its admissions and spendings in
    the last 60 s, and its tokens of the UTC day."""

    def __init__(self) -> None:
        self._windows: dict[tuple[str, str], _Window] = {}

    def _window(self, route: str, key: str, now: float) -> _Window:
        window = self._windows.get((route, key))
        if window is None:
            window = self._windows[(route, key)] = _Window()
        window.trim(now)
        return window

    def wait(self, route: str, key: str, limits: KeyLimits, now: float) -> float:
        window = self._window(route, key, now)
        wait = 0.0
        if limits.tokens_per_day is not None and window.day_tokens >= limits.tokens_per_day:
            wait = max(wait, to_midnight(now))
        if limits.tokens_per_minute is not None and window.tokens_sum >= limits.tokens_per_minute:
            left = window.tokens_sum
            for at, tokens in window.tokens:
                left -= tokens
                if left < limits.tokens_per_minute:
                    wait = max(wait, at + MINUTE - now)
                    break
        rpm = limits.requests_per_minute
        if rpm is not None and len(window.requests) >= rpm:
            wait = max(wait, window.requests[len(window.requests) - rpm] + MINUTE - now)
        return wait

    def admit(self, route: str, key: str, now: float) -> None:
        self._window(route, key, now).requests.append(now)

    def spend(self, route: str, key: str, tokens: int, now: float) -> None:
        window = self._window(route, key, now)
        window.tokens.append((now, tokens))
        window.tokens_sum += tokens
        window.day_tokens += tokens

    def spent(self, route: str, key: str, now: float) -> Spending:
        window = self._windows.get((route, key))
        if window is None:
            return Spending(0, 0, 0)
        window.trim(now)
        return Spending(len(window.requests), window.tokens_sum, window.day_tokens)

    def spending(self, now: float) -> dict[tuple[str, str], Spending]:
        out = {}
        for (route, key) in self._windows:
            window = self._window(route, key, now)
            out[(route, key)] = Spending(len(window.requests), window.tokens_sum, window.day_tokens)
        return out


class KeyLimiter:
    """Admissions and spending per (route, key) (see the module doc).

    :param now: POSIX seconds (``reactor.seconds``; a test's clock).
    :ivar counts: where admissions and spending are counted: this process's
        (:class:`ProcessCounts`), or with workers the box's
        (:class:`~crossbar.state.box_limits.BoxLimits`, :meth:`Runtime.attach
        <crossbar.state.runtime.Runtime.attach>`).
    :ivar fleet: with ``cluster.redis``, the fleet-wide check (:class:`RedisLimits`).
    """

    def __init__(self, now: Callable[[], float]) -> None:
        self.now = now
        self.counts: ILimitCounts = ProcessCounts()
        self._fleet: RedisLimits | None = None

    @property
    def fleet(self) -> RedisLimits | None:
        """See the class doc."""
        return self._fleet

    @fleet.setter
    def fleet(self, fleet: RedisLimits | None) -> None:
        self._fleet = fleet
        if fleet is not None:  # what was counted alone goes to Redis on (re)joining
            fleet.cluster.on_join.append(lambda: fleet.catch_up(self.now()))

    def wait(self, route: str, key: str, limits: KeyLimits) -> float:
        """Seconds until the local counts (this process's, or the box's) allow a
        request of ``key`` (0: now)."""
        return self.counts.wait(route, key, limits, self.now())

    def admitted(self, route: str, key: str) -> None:
        """Count one request of ``key`` admitted now."""
        self.counts.admit(route, key, self.now())

    def check(self, route: str, key: str, limits: KeyLimits) -> Deferred[float]:
        """Whether a request of ``key`` on ``route`` may start now (docs/design.md §Access):
        fires with 0 when it may (and counts it), else with the seconds until the
        window allows the next one (429). Fires at once without ``cluster``; with it,
        within :data:`~crossbar.state.cluster.BOUND` (the local counts decide when
        Redis does not answer in time). Never fails."""
        if not limits:
            return succeed(0.0)
        fleet = self.fleet
        if fleet is None:
            return succeed(self._local(route, key, limits))
        member = fleet.member()
        if not fleet.cluster.joined:
            return succeed(self._local(route, key, limits, member))
        d = fleet.check(route, key, limits, self.now(), member)

        def answered(wait: float) -> float:
            if not wait:
                self.admitted(route, key)
            return wait

        def unanswered(failure: Failure) -> float:
            fleet.cluster.slow_checks.note("check of a key's limits", failure)
            return self._local(route, key, limits, member)

        return d.addCallbacks(answered, unanswered)

    def _local(self, route: str, key: str, limits: KeyLimits, member: str | None = None) -> float:
        """The local counts decide; an admission Redis did not count (``member``: its
        id in Redis's window) is kept for when the instance rejoins."""
        now = self.now()
        wait = self.counts.wait(route, key, limits, now)
        if not wait:
            self.counts.admit(route, key, now)
            if member is not None and self.fleet is not None:
                self.fleet.admitted_alone(route, key, now, member)
        return wait

    def spend(self, route: str, key: str, tokens: int) -> None:
        """``key`` on ``route`` spent ``tokens`` (prompt + generated, as the host
        reported them) with an answer that ended now. Never waits; with ``cluster``
        the fleet's counters are raised too."""
        if tokens <= 0 or not key:
            return
        now = self.now()
        self.counts.spend(route, key, tokens, now)
        if self.fleet is not None:
            self.fleet.spend(route, key, tokens, now)

    def spending(self) -> dict[tuple[str, str], Spending]:
        """(route, key) -> what was admitted and counted for it (this process's, or
        with workers the box's)."""
        return self.counts.spending(self.now())


_CHECK = """
local now = tonumber(ARGV[1])
local rpm, tpm, tpd = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local wait = 0
if tpd > 0 then
  local spent = tonumber(redis.call('GET', KEYS[3]) or '0')
  if spent >= tpd then wait = math.max(wait, tonumber(ARGV[6])) end
end
if tpm > 0 then
  local h = redis.call('HGETALL', KEYS[2])
  local buckets = {}
  local sum = 0
  for i = 1, #h, 2 do
    local sec = tonumber(h[i])
    if (sec + 1) * 1000 + 60000 <= now then
      redis.call('HDEL', KEYS[2], h[i])
    else
      sum = sum + tonumber(h[i + 1])
      buckets[#buckets + 1] = {sec, tonumber(h[i + 1])}
    end
  end
  if sum >= tpm then
    table.sort(buckets, function(a, b) return a[1] < b[1] end)
    for _, b in ipairs(buckets) do
      sum = sum - b[2]
      if sum < tpm then wait = math.max(wait, (b[1] + 1) * 1000 + 60000 - now); break end
    end
  end
end
if rpm > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 60000)
  local n = redis.call('ZCARD', KEYS[1])
  if n >= rpm then
    local oldest = redis.call('ZRANGE', KEYS[1], n - rpm, n - rpm, 'WITHSCORES')
    wait = math.max(wait, tonumber(oldest[2]) + 60000 - now)
  end
end
if wait > 0 then return wait end
redis.call('ZADD', KEYS[1], now, ARGV[5])
redis.call('PEXPIRE', KEYS[1], 61000)
return 0
"""
"""KEYS: requests (sorted set, score ms), tokens per second (hash), tokens today;
ARGV: now ms, rpm, tpm, tpd (0: off), a unique member, ms to midnight. Returns the ms
to wait (0: admitted and counted)."""

_SPEND = """
redis.call('HINCRBY', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], 62000)
redis.call('INCRBY', KEYS[2], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[3])
return 1
"""

_CATCH_UP = """
local n = tonumber(ARGV[1])
local i = 2
for _ = 1, n do
  redis.call('ZADD', KEYS[1], ARGV[i], ARGV[i + 1])
  i = i + 2
end
if n > 0 then redis.call('PEXPIRE', KEYS[1], 61000) end
local m = tonumber(ARGV[i])
i = i + 1
for _ = 1, m do
  redis.call('HINCRBY', KEYS[2], ARGV[i], ARGV[i + 1])
  i = i + 2
end
if m > 0 then redis.call('PEXPIRE', KEYS[2], 62000) end
for d = 3, #KEYS do
  redis.call('INCRBY', KEYS[d], ARGV[i])
  redis.call('EXPIRE', KEYS[d], ARGV[i + 1])
  i = i + 2
end
return 1
"""
"""KEYS: requests (sorted set), tokens per second (hash), then one tokens-of-a-day key per
day; ARGV: n, then n (ms, member) admissions; m, then m (second, tokens) buckets; then
per day key (tokens, seconds to expire). One key's backlog in one call: requests are
added under the member their failed check had (a check that ran late counts once)."""


class _Backlog:
    """What one (route, key) was admitted and spent that Redis has not counted."""

    __slots__ = ("admitted", "seconds", "days")

    def __init__(self) -> None:
        self.admitted: deque[tuple[int, str]] = deque()
        """(ms, member) of requests admitted alone in the last minute"""
        self.seconds: dict[int, int] = {}
        """POSIX second -> tokens spent alone in it (the last minute's)"""
        self.days: dict[str, int] = {}
        """UTC day (``YYYY-MM-DD``) -> tokens spent alone that day"""

    def trim(self, now: float) -> None:
        """Drop what has left the sliding minute (a day's tokens stay)."""
        edge = int(now * 1000) - int(MINUTE * 1000)
        while self.admitted and self.admitted[0][0] <= edge:
            self.admitted.popleft()
        if self.seconds and min(self.seconds) + MINUTE + 1 <= now:
            self.seconds = {sec: n for sec, n in self.seconds.items() if sec + MINUTE + 1 > now}


class RedisLimits:
    """The fleet-wide check and spending of :class:`KeyLimiter` (``cluster.redis``).

    :param cluster: the instance's Redis connection and state.
    """

    def __init__(self, cluster: RedisCluster) -> None:
        self.cluster = cluster
        self._ids = itertools.count()
        self._backlog: dict[tuple[str, str], _Backlog] = {}

    @staticmethod
    def _base(route: str, key: str) -> str:
        return f"crossbar:limit:{route}\0{key}:"

    @staticmethod
    def _day(now: float) -> str:
        return time.strftime("%Y-%m-%d", time.gmtime(now))

    def _keys(self, route: str, key: str, now: float) -> list[str]:
        base = self._base(route, key)
        return [base + "requests", base + "tokens", base + "day:" + self._day(now)]

    def member(self) -> str:
        """A fresh id for one request in a key's window (unique over the fleet)."""
        return f"{self.cluster.instance}:{next(self._ids)}"

    def check(self, route: str, key: str, limits: KeyLimits, now: float, member: str) -> Deferred[float]:
        """Fires with the seconds to wait (0: admitted and counted fleet-wide, as
        ``member``); fails when Redis does not answer within the bound."""
        ms = int(now * 1000)
        args = [ms, limits.requests_per_minute or 0, limits.tokens_per_minute or 0, limits.tokens_per_day or 0,
                member, int(to_midnight(now) * 1000)]
        d = self.cluster.command("eval", _CHECK, self._keys(route, key, now), args)
        return d.addCallback(lambda wait: int(wait) / 1000)

    def spend(self, route: str, key: str, tokens: int, now: float) -> None:
        """Add ``tokens`` to the fleet's counters (not waited for); alone, or with no
        connection to send it on, kept for when the instance rejoins."""
        if not self.cluster.joined:
            return self._spent_alone(route, key, tokens, now)
        keys = self._keys(route, key, now)[1:]
        expire = int(to_midnight(now)) + _DAY
        d = self.cluster.command("eval", _SPEND, keys, [int(now), tokens, expire])

        def unsent(failure: Failure) -> None:
            if failure.check(txredisapi.ConnectionError):  # never sent (a late reply was sent: it counts)
                self._spent_alone(route, key, tokens, now)

        d.addErrback(unsent)

    def admitted_alone(self, route: str, key: str, now: float, member: str) -> None:
        """A request of ``key`` was admitted at ``now`` by the local counts (Redis did
        not answer): written to Redis's window, as ``member``, when the instance rejoins."""
        backlog = self._backlog.setdefault((route, key), _Backlog())
        backlog.trim(now)
        backlog.admitted.append((int(now * 1000), member))

    def _spent_alone(self, route: str, key: str, tokens: int, now: float) -> None:
        backlog = self._backlog.setdefault((route, key), _Backlog())
        backlog.trim(now)
        backlog.seconds[int(now)] = backlog.seconds.get(int(now), 0) + tokens
        day = self._day(now)
        backlog.days[day] = backlog.days.get(day, 0) + tokens

    def catch_up(self, now: float) -> None:
        """The instance (re)joined at POSIX time ``now``: write what was admitted and
        spent alone to Redis, one script call per key (what does not get through is
        kept for the next time; requests are written under their ids, so twice counts
        once)."""
        backlog, self._backlog = self._backlog, {}
        for (route, key), b in backlog.items():
            base = self._base(route, key)
            keys = [base + "requests", base + "tokens"] + [base + "day:" + day for day in b.days]
            args: list[Any] = [len(b.admitted)]
            for ms, member in b.admitted:
                args += [ms, member]
            args.append(len(b.seconds))
            for sec, tokens in b.seconds.items():
                args += [sec, tokens]
            for day, tokens in b.days.items():  # kept until the day after it ends, as _SPEND does
                args += [tokens, max(1, int(calendar.timegm(time.strptime(day, "%Y-%m-%d")) + 2 * _DAY - now))]
            if len(args) == 2 and not b.days:
                continue
            # (not on a request's path: a second's bound rather than 50 ms)
            d = self.cluster.command("eval", _CATCH_UP, keys, args, bound=1.0)
            d.addErrback(self._not_caught_up, route, key, b)

    def _not_caught_up(self, failure: Failure, route: str, key: str, b: _Backlog) -> None:
        """Keep the requests (written under their ids: counted once whatever happened);
        the tokens too unless the call was sent (then it most likely ran)."""
        kept = self._backlog.setdefault((route, key), _Backlog())
        kept.admitted = deque(sorted([*b.admitted, *kept.admitted]))
        if failure.check(txredisapi.ConnectionError):
            for sec, n in b.seconds.items():
                kept.seconds[sec] = kept.seconds.get(sec, 0) + n
            for day, n in b.days.items():
                kept.days[day] = kept.days.get(day, 0) + n


class LimitsCollector(Collector):
    """``crossbar_key_spent`` per route, key and ``window`` (``requests_minute``,
    ``tokens_minute``, ``tokens_day``): this process's counts, or with workers the
    box's (every worker reports the same)."""

    def __init__(self, limiter: KeyLimiter) -> None:
        self._limiter = limiter

    def collect(self) -> Iterable[Metric]:
        spent = GaugeMetricFamily(
            "crossbar_key_spent", "What a client key was admitted (requests) and spent (tokens) in a window "
            "(with workers: by every worker of the box).", labels=("route", "key", "window"),
        )
        for (route, key), s in sorted(self._limiter.spending().items()):
            spent.add_metric((route, key, "requests_minute"), s.requests_minute)
            spent.add_metric((route, key, "tokens_minute"), s.tokens_minute)
            spent.add_metric((route, key, "tokens_day"), s.tokens_day)
        return [spent]

    def describe(self) -> Iterable[Metric]:
        return self.collect()

