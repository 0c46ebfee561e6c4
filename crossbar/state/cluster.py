"""Counts shared by several crossbars through Redis (docs/design.md §Several crossbars).

Each crossbar process (an *instance*: a whole crossbar, or one worker of one) keeps its
own counts -- requests in flight per host, per (route, host) and per client key -- in
one Redis hash of its own, ``crossbar:inst:<id>``, that expires :data:`TTL` seconds
after the instance last renewed it, and is listed in the sorted set ``crossbar:live``
(score: when it expires). Every write also PUBLISHes the changed fields (with a sequence
number) on one channel, so every other instance's view follows within milliseconds
and a slot freed anywhere wakes the requests waiting everywhere (§Choosing a host,
rule 4). Every :data:`RESYNC` seconds an instance reads every live hash back (one Lua
script): this drops an instance that died (its hash expired) and mends anything a
lost message missed.

A host drained or undrained through one instance (§Operations) is noted in the hash
``crossbar:drained`` (host -> 1) and PUBLISHed on a channel of its own: every instance
follows within milliseconds, and each read (every :data:`RESYNC` seconds, and when an
instance joins) brings the whole set, so one that joins later learns it.

Nothing on the request path waits for Redis longer than :data:`BOUND`:
:meth:`RedisCluster.set` only notes the new value (the changes of :data:`FLUSH` seconds
go in one write), :meth:`RedisCluster.others` reads the cached view, and
:meth:`RedisCluster.take` -- a request taking its place at a host with a
``max_inflight`` -- is one script call that raises this instance's count only while
every instance's together stay within the limit (§Several crossbars: room is taken, not
guessed), answered within the bound or decided by this instance's own view (logged at
most once a minute, counted in :attr:`RedisCluster.slow_checks`). A reply to the cluster's own
reads and writes that takes longer than :data:`BOUND` seconds, or a connection that is
gone, turns the instance *alone*: it logs it once, drops the other
instances' counts (room and limits then count this instance alone, as without
``cluster``), stays ready, and rejoins -- writing its whole state again -- once a read
succeeds.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Callable, Iterable, Protocol

import txredisapi
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from crossbar.config import HostTLSSettings, RedisURL
from crossbar.state.redislink import RedisLink


__all__ = [
    "BOUND", "FLUSH", "GAP", "HEARTBEAT", "RESYNC", "SETTLE", "SLOW_LOG", "TTL", "ClusterCollector", "ClusterView",
    "RedisCluster",
]

_log = Logger(namespace="crossbar.cluster")

TTL = 6.0
"""Seconds an instance's counts outlive its last renewal (a crashed instance's requests
stop counting within TTL + RESYNC < 10 s)."""
HEARTBEAT = 2.0
"""Seconds between renewals of this instance's hash."""
RESYNC = 1.0
"""Seconds between full reads of every live instance's counts."""
BOUND = 0.05
"""Seconds a Redis reply may take before the instance goes on alone (§Several crossbars)."""
FLUSH = 0.002
"""Seconds this instance's rising counts gather before one write takes them all to Redis
(and the other instances). A falling count (a freed slot) is written at the end of the
reactor turn."""
GAP = 0.005
"""Seconds at least between two writes of this instance (the changes in between gather):
under load one write carries many requests' changes, whatever the rate (a write costs
both instances far more CPU than a request's own count does). A freed slot still
reaches the other instances well within the 20 ms of §Several crossbars."""

SETTLE = 2.0
"""Seconds after start at the latest at which the instance is :attr:`~RedisCluster.settled`
(readiness waits for it: §Several crossbars), when Redis has neither answered nor refused."""

SLOW_LOG = 60.0
"""Seconds at least between two log lines about single checks over the bound."""

_SEQ = "#seq"
_CONNECTING = 2.5
"""Seconds after start during which "not connected yet" is not news worth a log line."""

_WRITE = """
redis.call('HSET', KEYS[1], '#seq', ARGV[3], unpack(ARGV, 6))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[1]), ARGV[2])
if #ARGV > 5 then redis.call('PUBLISH', KEYS[3], ARGV[4]) end
local fields = {'#seq'}
for i = 6, #ARGV, 2 do fields[#fields + 1] = ARGV[i] end
local out = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], now, '+inf')) do
  if id ~= ARGV[2] then out[id] = redis.call('HMGET', ARGV[5] .. id, unpack(fields)) end
end
return cjson.encode(out)
"""
"""KEYS: own hash, live set, channel; ARGV: ttl ms, instance, seq, message, the hashes'
prefix, field, value, ... (HSET with several pairs: Redis >= 4). Returns every other
live instance (so each write, heartbeats included, tells how many there are) and, for
the fields written, its values as Redis holds them now, as one
JSON text ``{id: [seq, value, ...]}`` (missing: false) -- in Redis's one order of
writes, of two instances raising a count at once the second learns of the first.
Every reply is one string: txredisapi parses each element of an array reply in a
reactor turn of its own, which under load would stretch a reply past the bound."""

_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local field, value = ARGV[6], tonumber(ARGV[7])
local out = {}
local sum = 0
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], now, '+inf')) do
  if id ~= ARGV[2] then
    local v = redis.call('HMGET', ARGV[5] .. id, '#seq', field)
    out[id] = v
    if v[2] then sum = sum + tonumber(v[2]) end
  end
end
if sum + value > tonumber(ARGV[8]) then return cjson.encode({0, out}) end
redis.call('HSET', KEYS[1], '#seq', ARGV[3], field, value)
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[1]), ARGV[2])
redis.call('PUBLISH', KEYS[3], ARGV[4])
return cjson.encode({1, out})
"""
"""KEYS: own hash, live set, channel; ARGV: ttl ms, instance, seq, message, the hashes'
prefix, field, this instance's new count, the limit. Writes the count (as
:data:`_WRITE` does) only while every live instance's counts of ``field`` together
stay within the limit. Returns JSON ``[1 (taken) or 0 (refused), {id: [seq, value]}]``:
the other instances' counts as Redis holds them, which the view takes (after a refusal
it sees the host full)."""

_READ = """
local t = redis.call('TIME')
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
local out = {}
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  out[id] = redis.call('HGETALL', ARGV[1] .. id)
end
out['#drained'] = redis.call('HKEYS', KEYS[2])
return cjson.encode(out)
"""
"""KEYS: live set, drained hosts; ARGV: the hashes' prefix. Returns JSON
``{id: [field, value, ...], "#drained": [host, ...]}``."""

_DRAIN = """
for i = 1, #ARGV, 2 do
  if ARGV[i + 1] == '1' then redis.call('HSET', KEYS[1], ARGV[i], '1') else redis.call('HDEL', KEYS[1], ARGV[i]) end
end
redis.call('PUBLISH', KEYS[2], cjson.encode(ARGV))
return 1
"""
"""KEYS: drained hosts (hash), the drains channel; ARGV: host, '1' (drained) or '0', ...
The message is the JSON list of ARGV."""

_DRAINED_FIELD = "#drained"

_LEAVE = """
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('PUBLISH', KEYS[3], ARGV[2])
return 1
"""


class ClusterView(Protocol):
    """What the counts of :mod:`crossbar.state.inflight` and the runtime need of a
    cluster: a view of the other instances' counts and a place to put this one's."""

    @property
    def joined(self) -> bool:
        """True while the other instances' counts are known (Redis answers)."""

    @property
    def settled(self) -> bool:
        """The first connection to Redis has succeeded (the instance joined) or failed,
        or :data:`SETTLE` seconds have passed since start: readiness waits for it."""

    def others(self, name: str) -> int:
        """The sum of count ``name`` over every other live instance (0 when alone)."""

    def set(self, name: str, value: int) -> None:
        """This instance's count ``name`` is now ``value`` (never waits)."""

    def take(self, name: str, value: int, limit: int) -> Deferred[bool]:
        """This instance's count ``name`` rises to ``value`` (one request more) if every
        instance's together stay within ``limit``: fires True (taken; also when Redis
        does not answer within the bound or this instance is alone: its own view
        decided), or False (refused: the count stays as it was for the other
        instances, and the view now holds theirs). Never fails."""

    def instances(self) -> int:
        """Live instances known, this one included (1 when alone)."""

    def drain(self, host: str, draining: bool) -> None:
        """``host`` was drained (``draining``) or undrained through this instance: tell
        every instance, and Redis for those that join later (never waits)."""

    on_drains: Callable[[dict[str, bool], bool], None] | None
    """Called with (host -> draining, whole) when the drains are known from Redis:
    ``whole`` -- the full set (hosts absent are not draining), else one change."""


class OtherInstances:
    """What this instance knows of the other live instances' counts, as news of them
    arrives (their messages, the replies to its writes, its reads), each field kept at
    the newest sequence number seen.

    :ivar views: other instance -> field -> (the instance's seq when it had it, value).
    :ivar totals: field -> the sum over the other instances.
    """

    def __init__(self) -> None:
        self.views: dict[str, dict[str, tuple[int, int]]] = {}
        self.totals: dict[str, int] = {}

    def apply(self, instance: str, seq: int, fields: dict[str, int]) -> None:
        """``instance`` had ``fields`` at its ``seq``: keep each unless newer is known."""
        view = self.views.setdefault(instance, {})
        totals = self.totals
        for name, value in fields.items():
            known = view.get(name)
            if known is None or known[0] < seq:
                view[name] = (seq, value)
                totals[name] = totals.get(name, 0) + value - (known[1] if known is not None else 0)

    def largest(self, name: str) -> int:
        """The largest value of count ``name`` over the other instances (0 for none):
        e.g. the latest of their last uses of a model (docs/design.md §Where models live,
        rule 7; :mod:`crossbar.state.placement_share`)."""
        return max((view[name][1] for view in self.views.values() if name in view), default=0)

    def drop(self, instance: str) -> None:
        """``instance`` stopped: its counts count no more."""
        if self.views.pop(instance, None) is not None:
            self._recount()

    def replace(self, views: dict[str, dict[str, tuple[int, int]]]) -> None:
        """Every other live instance's counts are ``views`` (none while this one is alone)."""
        self.views = views
        self._recount()

    def read(self, doc: dict[str, Any]) -> None:
        """A read brought every other live instance's hash (instance -> its fields and
        values flat, its seq among them); a field newer news (a message, a write's
        reply) brought meanwhile is kept."""
        views: dict[str, dict[str, tuple[int, int]]] = {}
        for instance, flat in doc.items():
            if not isinstance(flat, list):
                continue
            fields = {str(flat[j]): int(flat[j + 1]) for j in range(0, len(flat) - 1, 2)}
            seq = fields.pop(_SEQ, 0)
            view = {name: (seq, value) for name, value in fields.items()}
            for name, (at, value) in self.views.get(instance, {}).items():
                if at > seq:
                    view[name] = (at, value)
            views[instance] = view
        self.replace(views)

    def _recount(self) -> None:
        totals: dict[str, int] = {}
        for fields in self.views.values():
            for name, (_, value) in fields.items():
                if value:
                    totals[name] = totals.get(name, 0) + value
        self.totals = totals


class ClusterDrains:
    """Host drains shared by every instance (docs/design.md §Operations, §Several
    crossbars): kept in the hash ``key`` (host -> 1) and published on ``channel``.

    :param command: the cluster's bounded Redis command.
    :ivar on_drains: told ``(changes, whole)``: host -> draining, and whether that is
        the whole set (a read) or news (a message).
    :ivar writes: drain writes sent so far: a read sent before the latest does not know it.
    """

    def __init__(self, key: str, channel: str, command: Callable[..., Deferred[Any]]) -> None:
        self.key, self.channel = key, channel
        self._command = command
        self.on_drains: Callable[[dict[str, bool], bool], None] | None = None
        self.writes = 0
        self._pending: dict[str, bool] = {}
        """drains done through this instance not yet written to Redis"""

    def note(self, host: str, draining: bool, joined: bool) -> None:
        """``host`` drained (or undrained) through this instance: written (and published)
        at once while ``joined``, else when the instance rejoins (:meth:`read`)."""
        self._pending[host] = draining
        if joined:
            self._write()

    def _write(self) -> None:
        drains, self._pending = self._pending, {}
        self.writes += 1
        args: list[str] = []
        for host, draining in drains.items():
            args += [host, "1" if draining else "0"]
        d = self._command("eval", _DRAIN, [self.key, self.channel], args, bound=max(BOUND, 1.0))

        def again(failure: Failure) -> None:  # Redis away: written when it rejoins (unless overtaken)
            self._pending = {**drains, **self._pending}

        d.addErrback(again)

    def read(self, drained: Any, writes_at_read: int) -> None:
        """A read brought the whole set (``drained``: the hosts): what was drained here
        while alone is written first (the next read brings it back); else, when no
        write went out since the read was sent, the set is what every instance follows."""
        if self._pending:
            self._write()
        elif writes_at_read == self.writes and self.on_drains is not None:
            self.on_drains({str(h): True for h in (drained if isinstance(drained, list) else [])}, True)

    def message(self, data: str | bytes) -> None:
        """One message on the drains channel (the subscriber's call)."""
        try:
            flat = json.loads(data)
            changes = {str(flat[i]): flat[i + 1] == "1" for i in range(0, len(flat) - 1, 2)}
        except (ValueError, TypeError, KeyError, IndexError):
            return
        if changes and self.on_drains is not None:
            self.on_drains(changes, False)


class SlowChecks:
    """The single checks (a take, a key's limits) Redis did not answer within the bound,
    so that this instance decided alone (docs/design.md §Several crossbars): counted,
    and logged at most every :data:`SLOW_LOG` seconds."""

    def __init__(self, url: RedisURL, reactor: Any) -> None:
        self.url, self.reactor = url, reactor
        self.count = 0
        self._said = float("-inf")

    def note(self, what: str, failure: Failure) -> None:
        """A single check (``what``) got ``failure`` instead of an answer in time."""
        self.count += 1
        now = self.reactor.seconds()
        if now - self._said >= SLOW_LOG:
            self._said = now
            _log.warn("cluster: Redis at {url} did not answer a {what} within {bound} ms ({error}); this "
                      "instance decided it alone ({slow} such checks so far; said at most once a minute)",
                      url=self.url.display(), what=what, bound=int(BOUND * 1000),
                      error=failure.getErrorMessage() or repr(failure.value), slow=self.count)


class RedisCluster:
    """This instance's share of the counts of several crossbars (see the module doc).

    :param url: the Redis (``cluster.redis``).
    :param reactor: the reactor (connections, timers).
    :param on_change: called (no arguments) when another instance's counts changed:
        a slot may have freed (the runtime wakes its queues).
    :param instance: this instance's id (default: a fresh random one).
    :param tls: ``cluster.tls`` for a ``rediss://`` URL (a CA to trust, mutual TLS), or
        None: the system trust store. An untrusted certificate never connects: the
        instance counts alone (logged once, like a Redis that does not answer).
    :ivar joined: see :class:`ClusterView`.
    :ivar settled: see :class:`ClusterView`.
    :ivar lost: how many times this instance went on alone (for the metrics).
    :ivar slow_checks: the single checks (a take, a key's limits) Redis did not answer
        within the bound, so this instance decided alone (:class:`SlowChecks`: counted
        for the metrics, logged once a minute).
    """

    def __init__(self, url: RedisURL, reactor: Any, on_change: Callable[[], None] | None = None,
                 instance: str | None = None, tls: HostTLSSettings | None = None) -> None:
        self.url, self.reactor, self.on_change = url, reactor, on_change
        self.instance = instance or uuid.uuid4().hex
        prefix = "crossbar:"
        self._hash_prefix = prefix + "inst:"
        self._hash = self._hash_prefix + self.instance
        self._live = prefix + "live"
        self._channel = f"{prefix}{url.db}:changes"
        self.drains = ClusterDrains(prefix + "drained", f"{prefix}{url.db}:drains", self.command)
        self.on_join: list[Callable[[], None]] = []
        """called (no arguments) each time the instance joins or rejoins, after its own
        counts were written (key limits write what they counted alone)"""
        self.joined = self.settled = False
        self.lost = 0
        self.slow_checks = SlowChecks(url, reactor)
        self._mine: dict[str, int] = {}
        self._dirty: set[str] = set()
        self._flush_call: Any = None
        self._sent_at = float("-inf")
        """when this instance's last write went out (reactor seconds)"""
        self._seq = 0
        self._others = OtherInstances()
        self.link = RedisLink(url, reactor, tls)
        self._resync = LoopingCall(self.resync)
        self._resync.clock = reactor
        self._heartbeat = LoopingCall(lambda: self._write({}) if self.joined else None)  # renew the hash
        self._heartbeat.clock = reactor
        self._reading = False
        self._said_alone = False
        self._started_at: float | None = None
        self._last_loss: str | None = None
        self._settle_call: Any = None

    # -- the view -------------------------------------------------------------------

    def others(self, name: str) -> int:
        """See :class:`ClusterView`."""
        return self._others.totals.get(name, 0) if self.joined else 0

    def instances(self) -> int:
        """Live instances known, this one included (1 when alone)."""
        return len(self._others.views) + 1 if self.joined else 1

    def largest(self, name: str) -> int:
        """See :meth:`OtherInstances.largest` (0 when alone)."""
        return self._others.largest(name) if self.joined else 0

    def set(self, name: str, value: int) -> None:
        """See :class:`ClusterView`: written to Redis within :data:`FLUSH` seconds."""
        old = self._mine.get(name, 0)
        if old == value and name not in self._dirty:
            return
        self._mine[name] = value
        self._dirty.add(name)
        if self.joined:
            self._schedule(value < old)

    def _schedule(self, falling: bool) -> None:
        """A write of the changed counts is due: at the end of this turn (``falling``)
        or within :data:`FLUSH`, and at least :data:`GAP` after the previous one."""
        # A freed slot goes out at the end of this reactor turn (requests wait for it on
        # other instances, §Choosing a host rule 4); rises gather for FLUSH (a host's
        # slot under a max_inflight is taken at once instead: take()); and a write
        # follows the previous one by GAP at least, so under load one write carries many
        # requests' changes.
        call = self._flush_call
        if falling:
            now = self.reactor.seconds()
            when = max(now, self._sent_at + GAP)
            if call is not None:
                if call.getTime() <= when:
                    return
                call.cancel()
            self._flush_call = self.reactor.callLater(when - now, self._flush)
        elif call is None:
            now = self.reactor.seconds()
            self._flush_call = self.reactor.callLater(max(now + FLUSH, self._sent_at + GAP) - now, self._flush)

    def take(self, name: str, value: int, limit: int) -> Deferred[bool]:
        """See :class:`ClusterView`: one :data:`_TAKE` script call, bounded by
        :data:`BOUND` (docs/design.md §Several crossbars: room is taken atomically)."""
        self._mine[name] = value
        if not self.joined:
            self._dirty.add(name)  # written when the instance rejoins
            return succeed(True)
        self._dirty.discard(name)  # this call writes it
        self._seq += 1
        message = json.dumps([self.instance, self._seq, {name: value}])
        d = self.command("eval", _TAKE, [self._hash, self._live, self._channel],
                         [int(TTL * 1000), self.instance, self._seq, message, self._hash_prefix, name, value, limit])
        return d.addCallbacks(self._taken, self._take_failed, callbackArgs=(name,), errbackArgs=(name,))

    def _taken(self, reply: str | bytes, name: str) -> bool:
        doc = json.loads(reply)
        taken, others = bool(doc[0]), doc[1] if isinstance(doc[1], dict) else {}
        if self.joined:
            for instance, values in others.items():
                if isinstance(values, list) and len(values) == 2 and values[0]:
                    self._others.apply(instance, int(values[0]), {name: int(values[1] or 0)})
        return taken

    def _take_failed(self, failure: Failure, name: str) -> bool:
        """No answer within the bound (or no connection): this instance's view decided;
        its count goes out with the next write."""
        self.slow_checks.note("take of a host's slot", failure)
        if name not in self._dirty:
            self._dirty.add(name)
            if self.joined:
                self._schedule(False)
        return True

    # -- host drains (docs/design.md §Operations) ----------------------------------------

    def drain(self, host: str, draining: bool) -> None:
        """See :class:`ClusterView`: written (and published) at once while joined, else
        when the instance rejoins (:class:`ClusterDrains`)."""
        self.drains.note(host, draining, self.joined)

    @property
    def on_drains(self) -> Callable[[dict[str, bool], bool], None] | None:
        """See :class:`ClusterView`."""
        return self.drains.on_drains

    @on_drains.setter
    def on_drains(self, tell: Callable[[dict[str, bool], bool], None] | None) -> None:
        self.drains.on_drains = tell

    # -- connecting -----------------------------------------------------------------

    def start(self) -> None:
        """Connect (in the background) and keep the view fresh."""
        # the first attempt refused (no Redis there, TLS refused): no need to wait longer
        self.link.connect(_SubscriberFactory(self), on_lost=self._lost, on_first_failure=self._settle,
                          connect_timeout=max(BOUND * 20, 1.0))
        self._started_at = self.reactor.seconds()
        self._settle_call = self.reactor.callLater(SETTLE, self._settle)
        self._resync.start(RESYNC, now=False)
        self._heartbeat.start(HEARTBEAT, now=False)
        self.reactor.callLater(0, self.resync)

    def _settle(self, _: object = None) -> None:
        """Redis answered, refused, or :data:`SETTLE` passed: readiness no longer waits."""
        self.settled = True
        call, self._settle_call = self._settle_call, None
        if call is not None and call.active():
            call.cancel()

    def stop(self) -> Deferred[Any]:
        """Remove this instance's counts from Redis (best effort) and disconnect."""
        self._settle()
        for loop in (self._resync, self._heartbeat):
            if loop.running:
                loop.stop()
        if self._flush_call is not None and self._flush_call.active():
            self._flush_call.cancel()
        self._flush_call = None
        if self.link.factory is None:
            return succeed(None)
        leave: Deferred[Any] = succeed(None)
        if self.joined and self.link.factory.size:
            gone = json.dumps([self.instance, -1, None])
            leave = self.command("eval", _LEAVE, [self._hash, self._live, self._channel], [self.instance, gone])
            leave.addErrback(lambda _: None)
        self.joined = False
        return leave.addCallback(lambda _: self.link.disconnect())

    # -- Redis commands -------------------------------------------------------------

    def command(self, name: str, *args: Any, bound: float | None = None) -> Deferred[Any]:
        """:meth:`RedisLink.command <crossbar.state.redislink.RedisLink.command>`, bounded by
        ``bound`` seconds (default :data:`BOUND`, read at each call so a test can set it)."""
        return self.link.command(name, *args, bound=BOUND if bound is None else bound)

    def _flush(self) -> None:
        self._flush_call = None
        if not self.joined or not self._dirty:
            return
        fields = {name: self._mine[name] for name in self._dirty}
        self._dirty.clear()
        self._write(fields)

    def _write(self, fields: dict[str, int]) -> None:
        self._sent_at = self.reactor.seconds()
        self._seq += 1
        message = json.dumps([self.instance, self._seq, fields]) if fields else ""
        args: list[Any] = [int(TTL * 1000), self.instance, self._seq, message, self._hash_prefix]
        names = list(fields)
        for name in names:
            args += [name, fields[name]]
        d = self.command("eval", _WRITE, [self._hash, self._live, self._channel], args)
        d.addCallbacks(self._written, self._failed, callbackArgs=(names,), errbackArgs=("write",))

    def _written(self, reply: str | bytes, names: list[str]) -> None:
        if not self.joined:
            return
        others = _object(reply)
        for instance, values in others.items():
            if not isinstance(values, list) or not values or not values[0]:
                continue  # expired meanwhile
            # An instance that has counted nothing yet still counts in instances().
            self._others.apply(instance, int(values[0]), {n: int(v) for n, v in zip(names, values[1:]) if v})
        self._changed()  # another instance's count may have fallen meanwhile

    def resync(self) -> None:
        """Read every live instance's counts (and find out whether Redis answers)."""
        if self._reading:
            return
        self._reading = True
        d = self.command("eval", _READ, [self._live, self.drains.key], [self._hash_prefix])
        d.addCallbacks(self._read, self._failed, callbackArgs=(self.drains.writes,), errbackArgs=("read",))
        d.addBoth(lambda _: setattr(self, "_reading", False))  # the next resync may read

    def _read(self, reply: str | bytes, drain_writes: int = 0) -> None:
        doc = _object(reply)
        drained = doc.pop(_DRAINED_FIELD, [])
        doc.pop(self.instance, None)
        self._others.read(doc)
        self._settle()
        if not self.joined:
            self.joined = True
            self._said_alone = False
            _log.info("cluster: sharing counts through Redis at {url} ({n} other instances)",
                      url=self.url.display(), n=len(self._others.views))
            self._dirty.update(self._mine)
            self._write(dict(self._mine))
            self._dirty.clear()
            for joined in self.on_join:
                joined()
        self.drains.read(drained, drain_writes)
        self._changed()

    def _lost(self, reason: Failure) -> None:
        """A connection to Redis ended: why, for the log line of :meth:`_failed`."""
        self._last_loss = reason.getErrorMessage() or repr(reason.value)

    def _failed(self, failure: Failure, what: str) -> None:
        starting = self._started_at is not None and self.reactor.seconds() - self._started_at < _CONNECTING
        if starting and not self.joined and failure.check(txredisapi.ConnectionError):
            return  # the first connection is still being made
        self._settle()  # connected, but Redis did not answer in time (or refused the command)
        if self.joined or not self._said_alone:
            self._said_alone = True
            error = failure.getErrorMessage() or repr(failure.value)
            if failure.check(txredisapi.ConnectionError) and self._last_loss:
                error += f"; the last connection ended: {self._last_loss}"  # e.g. an untrusted certificate
            _log.warn("cluster: Redis at {url} did not answer a {what} within {bound} ms ({error}); "
                      "counting this instance's requests alone until it does",
                      url=self.url.display(), what=what, bound=int(BOUND * 1000), error=error)
        if self.joined:
            self.lost += 1
            self.joined = False
            self._others.replace({})
            self._changed()

    # -- messages from other instances ----------------------------------------------

    def message(self, data: str | bytes) -> None:
        """One message on the channel (the subscriber's call)."""
        if not self.joined:
            return
        try:
            instance, seq, fields = json.loads(data)
        except (ValueError, TypeError):
            return
        if instance == self.instance:
            return
        if fields is None:  # an instance that stopped
            self._others.drop(str(instance))
        else:
            self._others.apply(str(instance), int(seq), {str(k): int(v) for k, v in fields.items()})
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()




def _object(reply: str | bytes) -> dict[str, Any]:
    """A script's JSON reply as a dict (Lua's cjson writes an empty table as ``{}``)."""
    doc = json.loads(reply)
    return doc if isinstance(doc, dict) else {}


class _SubscriberFactory(txredisapi.SubscriberFactory):  # type: ignore[misc]
    """txredisapi's subscriber, subscribed on every (re)connection, messages to the
    cluster."""

    def __init__(self, cluster: RedisCluster) -> None:
        super().__init__(isLazy=True)
        self.cluster = cluster

    def buildProtocol(self, addr: Any) -> Any:
        protocol = super().buildProtocol(addr)
        cluster = self.cluster

        def received(pattern: Any, channel: Any, message: Any) -> None:
            if channel in (cluster.drains.channel, cluster.drains.channel.encode()):
                cluster.drains.message(message)
            else:
                cluster.message(message)

        protocol.messageReceived = received

        def subscribe(p: Any) -> Any:
            d = p.subscribe([cluster._channel, cluster.drains.channel])
            d.addErrback(lambda _: None)
            # Whatever was published while the subscriber was away is mended by a read.
            cluster.reactor.callLater(0, cluster.resync)
            return p

        protocol.whenConnected().addCallback(subscribe)
        return protocol



class ClusterCollector(Collector):
    """The cluster's gauges, read at scrape time: ``crossbar_cluster_up`` (1 while
    this instance shares counts through Redis, 0 while it goes on alone),
    ``crossbar_cluster_instances`` (live instances seen, this one included),
    ``crossbar_cluster_lost_total`` (times it went on alone) and
    ``crossbar_cluster_slow_total`` (single checks over the bound, decided alone)."""

    def __init__(self, cluster: RedisCluster) -> None:
        self._cluster = cluster

    def collect(self) -> Iterable[Metric]:
        c = self._cluster
        up = GaugeMetricFamily("crossbar_cluster_up", "1 while counts are shared through Redis, 0 while alone.")
        up.add_metric((), 1 if c.joined else 0)
        instances = GaugeMetricFamily("crossbar_cluster_instances", "Live crossbar instances seen, this one included.")
        instances.add_metric((), c.instances())
        lost = CounterMetricFamily("crossbar_cluster_lost", "Times this instance lost Redis and went on alone.")
        lost.add_metric((), c.lost)
        slow = CounterMetricFamily("crossbar_cluster_slow", "Single checks (a host's slot, a key's limits) Redis "
                                   "did not answer within the bound: this instance decided alone.")
        slow.add_metric((), c.slow_checks.count)
        return [up, instances, lost, slow]

    def describe(self) -> Iterable[Metric]:
        return self.collect()
