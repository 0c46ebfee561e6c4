"""Token totals per host and per route, and their history in 10-second buckets: the
one store status and the dashboard read (docs/design.md §What the answers say: tokens,
speed, cache; §Operations: the dashboard's tokens/s and chart).

Each complete answer's figures are added here (prompt tokens processed, prompt tokens
from cache, tokens generated per host; processed and cached per route). With workers
the totals are published into this worker's row of the shared counts and read summed
over every worker (:class:`~crossbar.state.worker_counts.WorkerCounts`).

The history is a sample of the (box) totals at every bucket start (a multiple of
:data:`~crossbar.state.token_window.BUCKET` POSIX seconds: :meth:`TokenLedger.tick`
runs twice a second, and an answer or a read after a bucket start takes it first); a
bucket's tokens are the difference between its sample and the next (the last one's:
the totals now). With workers every worker samples the same shared totals, so each
holds the box's history (a restarted worker takes it back from its row's file,
:mod:`crossbar.state.token_history`); their timers run apart by up to half a second, so
an answer ending just after a bucket start may sit in either bucket of two workers,
which moves only the part of the oldest bucket the last minute counts. With
``cluster.redis`` the fleet's buckets are read from Redis instead
(:attr:`TokenLedger.share`, :mod:`crossbar.state.token_share`), this box's standing
in while Redis is away. :func:`~crossbar.state.token_window.window` and
:func:`~crossbar.state.token_window.chart` read the buckets, whoever filled them.
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger

from crossbar.state.cells import TOKENS, token_cell
from crossbar.state.counts import Counts
from crossbar.state.token_history import TokenHistory
from crossbar.state.token_window import BUCKET, KEEP, WINDOW, Buckets, Window, bucket_start, chart, window

__all__ = ["Cells", "HOST_KINDS", "ROUTE_KINDS", "TokenLedger", "TokenShare"]

HOST_KINDS = ("prompt", "cached", "generated")
ROUTE_KINDS = ("prompt", "cached")

Totals = dict[str, int]

_log = Logger(namespace="crossbar.ops")


class Cells:
    """What one (route, host)'s answers add to: the names of its five totals (host
    prompt, cached, generated; route prompt, cached) and, in one process, the tokens
    added since they were last folded into those totals (prompt, cached, generated):
    three list additions per answer instead of five dict updates (CPU per request).

    :ivar names: the five cell names (:func:`~crossbar.state.cells.token_cell`).
    :ivar pending: [prompt, cached, generated] not yet in the totals.
    """

    __slots__ = ("names", "pending")

    def __init__(self, names: tuple[str, str, str, str, str]) -> None:
        self.names = names
        self.pending = [0, 0, 0]


class TokenShare(Protocol):
    """The fleet's buckets kept elsewhere (Redis, :mod:`crossbar.state.token_share`)."""

    def view(self) -> Buckets | None:
        """The fleet's buckets as last read, or None when they stand for nothing now."""

    def fresh(self) -> Deferred[None]:
        """Fires when :meth:`view` is as fresh as it gets within the share's bound."""

    def tick(self) -> None:
        """Write what this process added since the last tick."""


class TokenLedger:
    """This process's token totals, the box's (with workers) and their history.

    :param now: POSIX seconds (``reactor.seconds``: bucket starts are the same in every
        process and instance).
    :param hosts: host names; :param routes: route names (see :meth:`configure`).
    :param counts: where the totals are published and read (with workers: every
        worker's, :class:`~crossbar.state.counts.Counts`).
    :ivar share: with ``cluster.redis``, the fleet's buckets in Redis; else None.
    :ivar history: with workers, where this worker's samples are kept on disk; else None.
    """

    def __init__(self, now: Callable[[], float], hosts: tuple[str, ...] = (), routes: tuple[str, ...] = (),
                 counts: Counts | None = None) -> None:
        self.now = now
        self.counts = counts if counts is not None else Counts()
        self.share: TokenShare | None = None
        self.history: TokenHistory | None = None
        self._mine: Totals = {}
        self._names: tuple[str, ...] = ()
        self._samples: dict[int, Totals] = {}  # bucket start -> the totals then, oldest first
        self._cells: dict[tuple[str, str], Cells] = {}
        self._next_sample = 0.0  # clock seconds from which add() takes a sample
        self.configure(hosts, routes)

    def configure(self, hosts: tuple[str, ...], routes: tuple[str, ...]) -> None:
        """Count for these hosts and routes (at start and after a reload); totals and
        history of names still configured are kept, a new name's history starts now."""
        self._names = tuple(token_cell("h", h, k) for h in hosts for k in HOST_KINDS) + tuple(
            token_cell("r", r, k) for r in routes for k in ROUTE_KINDS)
        if self._samples:
            self._fill()
        else:
            self._restart()

    def _fill(self) -> None:
        """A name missing from a sample had its total now then (its history starts now)."""
        totals = self.totals()
        for sample in self._samples.values():
            for name, value in totals.items():
                sample.setdefault(name, value)

    def _restart(self) -> None:
        """Start the history now: from what :attr:`history` kept, and the totals now."""
        now = self.now()
        start = bucket_start(now)
        kept = self.history.load(now - KEEP - 2 * BUCKET) if self.history is not None else {}
        self._samples = {s: totals for s, totals in kept.items() if s < start}
        totals = self._samples[start] = self.totals()
        self._next_sample = start + BUCKET
        self._fill()
        if self.history is not None:
            self.history.append(start, totals, self._samples)

    def attach(self, history: TokenHistory | None = None) -> None:
        """The :attr:`counts` are the workers' from now on: this process's totals are
        published there, and the history starts again from the box's totals (and what
        ``history``, this worker's row's file, kept of it)."""
        self.republish()
        self.history = history
        self._restart()

    def _fold(self) -> Totals:
        """This process's totals, with what :meth:`add_to` kept pending added in."""
        mine = self._mine
        for cells in self._cells.values():
            pending = cells.pending
            prompt, cached, generated = pending
            if prompt or cached or generated:
                pending[0] = pending[1] = pending[2] = 0
                for name, n in zip(cells.names, (prompt, cached, generated, prompt, cached)):
                    if n:
                        mine[name] = mine.get(name, 0) + n
        return mine

    def republish(self) -> None:
        """Write every total of this process where it is shared (after a reload)."""
        self._fold()
        for name, value in self._mine.items():
            self.counts.publish(TOKENS, name, value)

    def cells(self, route: str, host: str) -> Cells:
        """The :class:`Cells` an answer of ``route`` from ``host`` adds to (for
        :meth:`add_to`; the same for the ledger's whole life, reloads included)."""
        cells = self._cells.get((route, host))
        if cells is None:
            cells = self._cells[(route, host)] = Cells((
                token_cell("h", host, "prompt"), token_cell("h", host, "cached"), token_cell("h", host, "generated"),
                token_cell("r", route, "prompt"), token_cell("r", route, "cached")))
        return cells

    def add(self, route: str, host: str, prompt: int, cached: int, generated: int) -> None:
        """One complete answer of ``route`` from ``host`` read ``prompt`` tokens, took
        ``cached`` from the cache and generated ``generated``."""
        self.add_to(self.cells(route, host), prompt, cached, generated)

    def add_to(self, cells: Cells, prompt: int, cached: int, generated: int) -> None:
        """:meth:`add` with the answer's :meth:`cells` already known (the request log
        keeps them with its metric children: once per request, no lookup). In one
        process the tokens wait in ``cells`` until totals are read; with workers they
        are published at once."""
        if self.now() >= self._next_sample:
            self.sample()
        counts = self.counts
        if counts.fleet is None:  # nothing shared: a fold when read does
            pending = cells.pending
            pending[0] += prompt
            pending[1] += cached
            pending[2] += generated
            return
        mine = self._mine  # anything pending from before the fleet was folded by republish()
        for name, n in zip(cells.names, (prompt, cached, generated, prompt, cached)):
            if n:
                value = mine[name] = mine.get(name, 0) + n
                counts.publish(TOKENS, name, value)

    def own(self) -> Totals:
        """This process's totals, whatever the config names (what it writes to Redis);
        a live view: copy it to keep it."""
        return self._fold()

    def totals(self) -> Totals:
        """Every configured total (the box's with workers)."""
        mine, counts = self._fold(), self.counts
        return {name: counts.read(TOKENS, name, mine.get(name, 0)) for name in self._names}

    def sample(self) -> None:
        """Keep a sample of the totals if a bucket started since the last one, dropping
        those older than the chart."""
        now = self.now()
        if now < self._next_sample:
            return
        start = bucket_start(now)
        totals = self._samples[start] = self.totals()
        self._next_sample = start + BUCKET
        oldest = now - KEEP - 2 * BUCKET
        for old in [s for s in self._samples if s < oldest]:
            del self._samples[old]
        if self.history is not None:
            self.history.append(start, totals, self._samples)

    def tick(self) -> None:
        """The timer (twice a second): :meth:`sample`, and with a :attr:`share` write
        this process's new tokens there. Never raises (logged)."""
        try:
            self.sample()
            if self.share is not None:
                self.share.tick()
        except Exception:
            _log.failure("token figures not sampled")

    def box_buckets(self, since: float | None = None, names: Iterable[str] | None = None) -> Buckets:
        """This box's buckets (this process's, or every worker's), from the samples;
        with ``since`` (POSIX s) only those reaching past it, with ``names`` only those
        cells."""
        self.sample()
        samples = list(self._samples.items())
        if since is not None:
            first = len(samples) - 1
            while first > 0 and samples[first][0] > since:
                first -= 1
            samples = samples[first:]
        upto = [totals for _, totals in samples[1:]] + [self.totals()]
        wanted = list(names) if names is not None else None
        out: dict[int, dict[str, float]] = {}
        for (start, base), after in zip(samples, upto):
            pairs = after.items() if wanted is None else ((name, after.get(name, 0)) for name in wanted)
            cells = {name: float(value - base.get(name, 0)) for name, value in pairs if value > base.get(name, 0)}
            if cells:
                out[start] = cells
        return out

    def buckets(self, since: float | None = None, names: Iterable[str] | None = None) -> Buckets:
        """The buckets status and the dashboard read: the fleet's from Redis while they
        stand for it (:attr:`share`), else this box's (with ``since`` and ``names``, at
        least those reaching past it, of those cells: :meth:`box_buckets`)."""
        fleet = self.share.view() if self.share is not None else None
        return fleet if fleet is not None else self.box_buckets(since, names)

    def fresh(self) -> Deferred[None]:
        """Fires when :meth:`buckets` is as fresh as it gets: at once, or with
        ``cluster.redis`` after a read of Redis (bounded). Never fails."""
        return self.share.fresh() if self.share is not None else succeed(None)

    def window(self) -> Window:
        """The last minute of :meth:`buckets` (:func:`~crossbar.state.token_window.window`)."""
        now = self.now()
        return window(self.buckets(now - WINDOW), now)

    def chart(self, hosts: list[str]) -> dict[str, list[float]]:
        """host -> tokens generated per second per bucket over the last 15 minutes
        (:func:`~crossbar.state.token_window.chart`) of :meth:`buckets`."""
        now = self.now()
        return chart(self.buckets(names=[token_cell("h", h, "generated") for h in hosts]), hosts, now)
