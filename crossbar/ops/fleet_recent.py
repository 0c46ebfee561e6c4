"""The dashboard's recent requests for several crossbars, through the Redis of
``cluster.redis`` (docs/design.md §Operations, the dashboard, and §Several crossbars):
the same list whichever instance (or worker) answers. (Its token figures come from the
token store, which sums the fleet's through Redis too: :mod:`crossbar.state.token_share`.)

What goes to Redis, in one script call per instance from the timer
(:meth:`FleetRecent.tick`, every :data:`~crossbar.ops.recent.TICK` seconds), never on the
request path and never with anything waiting for it: **display entries**
(:func:`~crossbar.ops.recent.entry`: no body, query string or secret) only while someone
looks, pushed onto one capped list (``crossbar:dash:recent``, the newest
:data:`KEEP_ENTRIES`). The instance serving the page sets ``crossbar:dash:watch``
(expiring after :data:`~crossbar.ops.recent.WATCH_TTL` s) with each read; every write's
reply says how long it still lives. When an instance learns that someone looks it
pushes the newest of its ring it has not pushed yet (up to
:data:`~crossbar.ops.recent.RECENT`), so a request answered before the page opened is
listed too. An instance holding requests it has not pushed asks at most once every
:data:`ASK_EVERY` seconds, for :data:`UNSHOWN` seconds after its last request.

So with nobody looking, the cost per request is the append that runs anyway, and at most
one small write per instance per second while requests come.

The page's list (:meth:`FleetRecent.view`) is the last read of Redis (one script call),
made while someone looks at most every :data:`~crossbar.ops.recent.TICK` s and bounded
by :data:`READ_BOUND`. When Redis does not answer (or the cluster goes on alone), the
view falls back to this crossbar's own (this process's, or every worker's through their
files) and :meth:`scope` says so.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from crossbar.ops.recent import TICK, WATCH_TTL, RecentRequests
from crossbar.state.cluster import RedisCluster

__all__ = ["ASK_EVERY", "KEEP_ENTRIES", "PREFIX", "READ_BOUND", "STALE", "UNSHOWN", "FleetRecent"]

_log = Logger(namespace="crossbar.ops")

PREFIX = "crossbar:dash:"
"""Every Redis key of the dashboard starts with this."""
KEEP_ENTRIES = 500
"""Entries the fleet's list keeps (the page shows the newest 200)."""
READ = 300
"""Entries read per look (the list is in the order pushed; the page sorts by time)."""
READ_BOUND = 0.5
"""Seconds a read or write of the dashboard's data may take (nothing waits on a
write; a page waits at most this long for a read, then gets this crossbar's own view)."""
STALE = 3.0
"""Seconds a read of Redis stands for the fleet's view; older, the local view is shown."""
ASK_EVERY = 1.0
"""Seconds between two "does anyone look?" questions of an instance holding requests
it has not pushed."""
UNSHOWN = 15 * 60
"""Seconds after its last request an instance holding requests it has not pushed
still asks."""
_LIST_TTL = 3600
"""Seconds the fleet's list outlives its last push."""

_PUSH = """
local n = tonumber(ARGV[2])
if n > 0 then
  redis.call('LPUSH', KEYS[1], unpack(ARGV, 3, 2 + n))
  redis.call('LTRIM', KEYS[1], 0, tonumber(ARGV[1]) - 1)
  redis.call('EXPIRE', KEYS[1], ARGV[3 + n])
end
return redis.call('PTTL', KEYS[2])
"""
"""KEYS: list, watch; ARGV: list length, n, n entries (oldest first), list ttl s.
Returns the watch key's milliseconds to live (negative: nobody looks)."""

_READ = """
redis.call('SET', KEYS[2], '1', 'PX', ARGV[1])
local entries = redis.call('LRANGE', KEYS[1], 0, tonumber(ARGV[2]) - 1)
return '{"recent":[' .. table.concat(entries, ',') .. ']}'
"""
"""KEYS: list, watch; ARGV: watch ttl ms, entries. Marks the fleet watched; returns
one JSON text (one string: see :mod:`crossbar.state.cluster` on array replies)."""


class FleetRecent(RecentRequests):
    """:class:`~crossbar.ops.recent.RecentRequests` shared through Redis (see the
    module doc).

    :param now: POSIX seconds (``reactor.seconds``).
    :param cluster: the instance's Redis connection (``cluster.redis``).
    :param directory: with workers, the workers' state directory (the fallback view).
    :param row: this worker's row.
    """

    def __init__(self, now: Callable[[], float], cluster: RedisCluster, directory: str | None = None,
                 row: int = 0) -> None:
        super().__init__(now, directory, row)
        self.cluster = cluster
        self._list = PREFIX + "recent"
        self._watch = PREFIX + "watch"
        self._pushed = 0  # entries (self.made) pushed so far
        self._asked_upto = 0  # records (appended) covered by the last write
        self._asked_at = -1e18
        self._last_record = -1e18
        self._watched_until = -1e18
        self._writing = False
        self._reading: Deferred[None] | None = None
        self._waiting: list[Deferred[None]] = []
        self._read_at = -1e18
        self._fleet: list[dict[str, Any]] | None = None
        self._note: str | None = "not read from Redis yet"

    # -- writing --------------------------------------------------------------------

    def tick(self) -> None:
        """The base class's tick, then write what there is to Redis. Never raises."""
        super().tick()
        try:
            self.push()
        except Exception:
            _log.failure("dashboard figures not written to Redis")

    def _fleet_watched(self) -> bool:
        return self._now() < self._watched_until

    def push(self) -> None:
        """One write of the unpushed entries while someone looks, and the question
        whether someone looks (see the module doc); at most one at a time."""
        now = self._now()
        if self._writing or not self.cluster.joined:
            return
        appended = self._appended
        if appended != self._asked_upto:
            self._last_record = now
        entries: list[dict[str, Any]] = []
        if self._fleet_watched():
            self.make_entries()
            new = min(self.made - self._pushed, len(self.entries))
            entries = [self.entries[i] for i in range(len(self.entries) - new, len(self.entries))]
        unshown = appended > self._made or self._pushed < self.made
        ask = unshown and now - self._last_record < UNSHOWN and now - self._asked_at >= ASK_EVERY
        if not (entries or ask):
            return
        made = self.made
        args: list[Any] = [KEEP_ENTRIES, len(entries)]
        args += [json.dumps(e, separators=(",", ":")) for e in entries]
        args.append(_LIST_TTL)
        self._writing = True
        self._asked_at = now
        self._asked_upto = appended
        d = self.cluster.command("eval", _PUSH, [self._list, self._watch], args, bound=READ_BOUND)
        d.addCallbacks(self._pushed_ok, self._push_failed, callbackArgs=(made if entries else None,))

    def _pushed_ok(self, reply: Any, made: int | None) -> None:
        self._writing = False
        if made is not None:
            self._pushed = made
        try:
            ttl = int(reply)
        except (TypeError, ValueError):
            ttl = -1
        was = self._fleet_watched()
        self._watched_until = self._now() + ttl / 1000.0 if ttl > 0 else -1e18
        if self._fleet_watched() and not was:
            self.push()  # someone looks now: this instance's newest requests at once

    def _push_failed(self, failure: Failure) -> None:
        self._writing = False

    # -- reading --------------------------------------------------------------------

    def fresh(self) -> Deferred[None]:
        """Fires when a read of Redis started now (or less than :data:`TICK` s ago)
        is done, or failed, or :data:`READ_BOUND` s passed. Never fails."""
        if not self.cluster.joined or self._now() - self._read_at < TICK:
            return succeed(None)
        waiting: Deferred[None] = Deferred()
        self._waiting.append(waiting)
        if self._reading is None:
            self._read()
        return waiting

    def _read(self) -> None:
        now = self._now()
        self._watched_until = now + WATCH_TTL  # this instance's own requests go out on its tick
        args = [int(WATCH_TTL * 1000), READ]
        d: Deferred[Any] = self.cluster.command("eval", _READ, [self._list, self._watch], args, bound=READ_BOUND)
        self._reading = d
        d.addCallbacks(self._got, self._read_failed)
        d.addBoth(self._read_done)

    def _got(self, reply: str | bytes) -> None:
        doc = json.loads(reply)
        entries = [e for e in doc.get("recent", ()) if isinstance(e, dict)]
        entries.sort(key=lambda e: e.get("t", 0) if isinstance(e.get("t"), (int, float)) else 0, reverse=True)
        self._fleet = entries
        self._read_at = self._now()
        self._note = None

    def _read_failed(self, failure: Failure) -> None:
        error = failure.getErrorMessage() or type(failure.value).__name__
        if self._note is None:
            _log.warn("dashboard: Redis did not answer a read within {bound} ms ({error}); "
                      "showing this crossbar's own requests", bound=int(READ_BOUND * 1000), error=error)
        self._note = f"Redis did not answer within {int(READ_BOUND * 1000)} ms: this crossbar's requests only"

    def _read_done(self, _: object) -> None:
        self._reading = None
        waiting, self._waiting = self._waiting, []
        for d in waiting:
            d.callback(None)

    def _fleet_view(self) -> list[dict[str, Any]] | None:
        if self._fleet is None or not self.cluster.joined or self._now() - self._read_at > STALE:
            return None
        return self._fleet

    def view(self) -> list[dict[str, Any]]:
        """The fleet's view as last read from Redis (a new read is started when it is
        older than :data:`TICK`); this crossbar's own when that is older than
        :data:`STALE` s or Redis is away."""
        if self.cluster.joined and self._reading is None and self._now() - self._read_at >= TICK:
            self._read()
        fleet = self._fleet_view()
        if fleet is not None:
            return fleet
        return super().view()

    def scope(self) -> dict[str, Any]:
        """``shared``: ``fleet`` while the view is read from Redis; else the base
        class's, with a ``note`` saying why."""
        if self._fleet_view() is not None:
            return {"shared": "fleet", "note": None}
        base = super().scope()
        if not self.cluster.joined:
            note = "Redis is away: this crossbar's requests only"
        else:
            note = self._note or "Redis not read yet: this crossbar's requests only"
        return {**base, "note": note}
