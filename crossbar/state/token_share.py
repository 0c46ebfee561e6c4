"""The fleet's token buckets in Redis, for several crossbars (docs/design.md §What the
answers say: "with several crossbars, counts are summed"; §Several crossbars;
§Operations: the dashboard): what status and the dashboard read with ``cluster.redis``.

Each instance (a crossbar, or one worker of one) adds the tokens it counted since its
last write into one Redis hash per 10-second bucket, ``crossbar:tok:<start>`` (fields:
the token cell names, :func:`~crossbar.state.cells.token_cell`), that expires after the
chart's 15 minutes: one script call from the timer (:meth:`RedisTokens.tick`), never on
the request path, only when there is something new. A write that fails, or that
cannot be made while the instance is alone, is kept and added with the next one (a
bucket older than the chart is dropped).

Reading (:meth:`RedisTokens.fresh`) is one script call for the chart's buckets, made
when status or the dashboard asks and the last read is older than :data:`TICK`,
bounded by :data:`READ_BOUND`. :meth:`RedisTokens.view` is that read while it is at
most :data:`STALE` seconds old and the instance is joined; otherwise None, and the
ledger reads this box's own buckets.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Protocol

from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from crossbar.state.token_window import BUCKET, KEEP, Buckets, bucket_start
from crossbar.state.tokens import TokenLedger

__all__ = ["PREFIX", "READ_BOUND", "STALE", "TICK", "RedisCommands", "RedisTokens"]

_log = Logger(namespace="crossbar.cluster")

PREFIX = "crossbar:tok:"
"""Every bucket's Redis key starts with this."""
TICK = 0.5
"""Seconds between writes (the service's timer), and the age a read stays fresh."""
READ_BOUND = 0.5
"""Seconds a read or write may take (a reader waits at most this long)."""
STALE = 3.0
"""Seconds a read stands for the fleet; older, this box's buckets are read."""

_PUSH = """
for i = 3, #ARGV, 3 do
  local key = ARGV[1] .. ARGV[i]
  redis.call('HINCRBY', key, ARGV[i + 1], ARGV[i + 2])
  redis.call('EXPIRE', key, ARGV[2])
end
return 1
"""
"""ARGV: bucket prefix, bucket ttl s, then (bucket start, cell, tokens) triples."""

_READ = """
local buckets = {}
for s = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]) do
  local flat = redis.call('HGETALL', ARGV[1] .. string.format('%d', s))
  if #flat > 0 then buckets[string.format('%d', s)] = flat end
end
return cjson.encode(buckets)
"""
"""ARGV: bucket prefix, first start, last start, step. One JSON text (a string: see
:mod:`crossbar.state.cluster` on array replies); an empty table is ``{}``."""


class RedisCommands(Protocol):
    """What of :class:`~crossbar.state.cluster.RedisCluster` the share uses."""

    @property
    def joined(self) -> bool:
        """Whether the instance shares its counts now."""

    def command(self, name: str, *args: Any, bound: float | None = None) -> Deferred[Any]:
        """One Redis command, failing after ``bound`` seconds."""


class RedisTokens:
    """The fleet's buckets through Redis (see the module doc).

    :param ledger: this process's ledger (what it counted: :meth:`TokenLedger.own`);
        the share makes itself its :attr:`~TokenLedger.share`.
    :param cluster: the instance's Redis connection.
    :param now: POSIX seconds.
    """

    def __init__(self, ledger: TokenLedger, cluster: RedisCommands, now: Callable[[], float]) -> None:
        self.ledger = ledger
        self.cluster = cluster
        self.now = now
        self.unwritten: dict[tuple[int, str], int] = {}
        """(bucket start, cell) -> tokens not written yet."""
        self._written = dict(ledger.own())  # what the tokens since are counted from
        self._writing = False
        self._reading: Deferred[None] | None = None
        self._waiting: list[Deferred[None]] = []
        self._read_at = -1e18
        self._fleet: Buckets | None = None
        ledger.share = self

    # -- writing --------------------------------------------------------------------

    def tick(self) -> None:
        """Note the tokens counted since the last tick (in the bucket of now) and write
        what is unwritten, one write at a time. Never raises."""
        now = self.now()
        start = bucket_start(now)
        unwritten = self.unwritten
        written = self._written
        for name, value in self.ledger.own().items():
            n = value - written.get(name, 0)
            if n > 0:
                unwritten[(start, name)] = unwritten.get((start, name), 0) + n
                written[name] = value
        oldest = now - KEEP - BUCKET
        for cell in [c for c in unwritten if c[0] < oldest]:  # older than the chart: dropped
            del unwritten[cell]
        if self._writing or not unwritten or not self.cluster.joined:
            return
        tokens, self.unwritten = unwritten, {}
        args: list[Any] = [PREFIX, int(KEEP + 2 * BUCKET)]
        for (at, name), n in tokens.items():
            args += [at, name, n]
        self._writing = True
        d = self.cluster.command("eval", _PUSH, [], args, bound=READ_BOUND)
        d.addCallbacks(self._written_ok, self._write_failed, errbackArgs=(tokens,))

    def _written_ok(self, _: object) -> None:
        self._writing = False

    def _write_failed(self, failure: Failure, tokens: dict[tuple[int, str], int]) -> None:
        self._writing = False
        for cell, n in tokens.items():  # added again with the next write
            self.unwritten[cell] = self.unwritten.get(cell, 0) + n

    # -- reading --------------------------------------------------------------------

    def fresh(self) -> Deferred[None]:
        """Fires when a read started now (or less than :data:`TICK` s ago) is done, or
        failed, or :data:`READ_BOUND` s passed. Never fails."""
        if not self.cluster.joined or self.now() - self._read_at < TICK:
            return succeed(None)
        waiting: Deferred[None] = Deferred()
        self._waiting.append(waiting)
        if self._reading is None:
            now = self.now()
            args = [PREFIX, bucket_start(now - KEEP), bucket_start(now), BUCKET]
            d: Deferred[Any] = self.cluster.command("eval", _READ, [], args, bound=READ_BOUND)
            self._reading = d
            d.addCallbacks(self._got, self._read_failed)
            d.addBoth(self._read_done)
        return waiting

    def _got(self, reply: str | bytes) -> None:
        doc = json.loads(reply)
        buckets: dict[int, dict[str, float]] = {}
        for start, flat in (doc.items() if isinstance(doc, dict) else ()):
            cells = buckets.setdefault(int(start), {})
            for j in range(0, len(flat) - 1, 2):
                name = str(flat[j])
                cells[name] = cells.get(name, 0.0) + float(flat[j + 1])
        self._fleet = buckets
        self._read_at = self.now()

    def _read_failed(self, failure: Failure) -> None:
        _log.debug("token buckets not read from Redis: {error}", error=failure.getErrorMessage())

    def _read_done(self, _: object) -> None:
        self._reading = None
        waiting, self._waiting = self._waiting, []
        for d in waiting:
            d.callback(None)

    def view(self) -> Buckets | None:
        """The fleet's buckets as last read; None when that is older than
        :data:`STALE` s or the instance is alone (this box's stand in)."""
        if self._fleet is None or not self.cluster.joined or self.now() - self._read_at > STALE:
            return None
        return self._fleet
