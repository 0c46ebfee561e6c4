"""Token totals per host and per route, and their last minute, for ``status``
(docs/design.md §What the answers say: tokens, speed, cache).

Each complete answer's figures are added here (prompt tokens processed, prompt tokens
from cache, tokens generated per host; processed and cached per route). With workers
the totals are published into this worker's row of the shared counts and read summed
over every worker (:class:`~crossbar.state.worker_counts.WorkerCounts`), so status gives the
same figures whichever worker answers.

The last minute is a difference of totals: :meth:`TokenLedger.sample` keeps a sample of
the (fleet) totals at most every :data:`SAMPLE_EVERY` seconds, and :meth:`window` reads
the totals now minus the newest sample at least :data:`WINDOW` seconds old (the oldest
sample while crossbar is younger than that), over the seconds between them.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Mapping

from crossbar.state.worker_counts import WorkerCounts, token_cell

__all__ = ["Cells", "HOST_KINDS", "ROUTE_KINDS", "SAMPLE_EVERY", "TokenLedger", "WINDOW", "Window"]

HOST_KINDS = ("prompt", "cached", "generated")
ROUTE_KINDS = ("prompt", "cached")
WINDOW = 60.0
"""Seconds of 'the last minute'."""
SAMPLE_EVERY = 5.0
"""Seconds between samples of the totals."""

Totals = dict[str, int]


class Cells:
    """What one (route, host)'s answers add to: the names of its five totals (host
    prompt, cached, generated; route prompt, cached) and, in one process, the tokens
    added since they were last folded into those totals (prompt, cached, generated):
    three list additions per answer instead of five dict updates (CPU per request).

    :ivar names: the five cell names (:func:`~crossbar.state.worker_counts.token_cell`).
    :ivar pending: [prompt, cached, generated] not yet in the totals.
    """

    __slots__ = ("names", "pending")

    def __init__(self, names: tuple[str, str, str, str, str]) -> None:
        self.names = names
        self.pending = [0, 0, 0]


class Window:
    """Token counts over a span of time.

    :ivar seconds: the span's length.
    :ivar counts: cell name (:func:`~crossbar.state.worker_counts.token_cell`) -> tokens.
    """

    def __init__(self, seconds: float, counts: Mapping[str, int]) -> None:
        self.seconds = seconds
        self.counts = counts

    def _get(self, scope: str, name: str, kind: str) -> int:
        return self.counts.get(token_cell(scope, name, kind), 0)

    def generated_per_second(self, host: str) -> float:
        """Tokens ``host`` generated per second over the window (0.0 for an empty one)."""
        return self._get("h", host, "generated") / self.seconds if self.seconds > 0 else 0.0

    def cached_share(self, scope: str, name: str) -> float | None:
        """Cached prompt tokens / all prompt tokens of a host (``scope`` "h") or route
        ("r") over the window; None when it read no prompt token."""
        cached = self._get(scope, name, "cached")
        total = cached + self._get(scope, name, "prompt")
        return cached / total if total > 0 else None


class TokenLedger:
    """This process's token totals (and the fleet's, with workers).

    :param now: clock seconds.
    :param hosts: host names; :param routes: route names (see :meth:`configure`).
    """

    def __init__(self, now: Callable[[], float], hosts: tuple[str, ...] = (), routes: tuple[str, ...] = ()) -> None:
        self.now = now
        self.fleet: WorkerCounts | None = None
        self._mine: Totals = {}
        self._names: tuple[str, ...] = ()
        self._samples: deque[tuple[float, Totals]] = deque()
        self._cells: dict[tuple[str, str], Cells] = {}
        self._next_sample = 0.0  # clock seconds from which add() takes a sample
        self.configure(hosts, routes)

    def configure(self, hosts: tuple[str, ...], routes: tuple[str, ...]) -> None:
        """Count for these hosts and routes (at start and after a reload); totals of
        names still configured are kept."""
        self._names = tuple(token_cell("h", h, k) for h in hosts for k in HOST_KINDS) + tuple(
            token_cell("r", r, k) for r in routes for k in ROUTE_KINDS)
        if not self._samples:
            now = self.now()
            self._samples.append((now, self.totals()))
            self._next_sample = now + SAMPLE_EVERY

    def attach(self, fleet: WorkerCounts) -> None:
        """Publish to and read from ``fleet`` from now on."""
        self.fleet = fleet
        self.republish()

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
        """Write every total of this process into the fleet (after a reload)."""
        self._fold()
        if self.fleet is not None:
            for name, value in self._mine.items():
                self.fleet.publish_tokens(name, value)

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
        fleet = self.fleet
        if fleet is None:
            pending = cells.pending
            pending[0] += prompt
            pending[1] += cached
            pending[2] += generated
            return
        mine = self._mine  # anything pending from before the fleet was folded by republish()
        for name, n in zip(cells.names, (prompt, cached, generated, prompt, cached)):
            if n:
                value = mine[name] = mine.get(name, 0) + n
                fleet.publish_tokens(name, value)

    def totals(self) -> Totals:
        """Every configured total (the fleet's with workers)."""
        if self.fleet is not None:
            fleet = self.fleet
            return {name: fleet.tokens(name) for name in self._names}
        mine = self._fold()
        return {name: mine.get(name, 0) for name in self._names}

    def sample(self) -> None:
        """Keep a sample of the totals if the last one is :data:`SAMPLE_EVERY` old,
        dropping those no window needs any more."""
        now = self.now()
        samples = self._samples
        if samples and now - samples[-1][0] < SAMPLE_EVERY:
            self._next_sample = samples[-1][0] + SAMPLE_EVERY
            return
        samples.append((now, self.totals()))
        self._next_sample = now + SAMPLE_EVERY
        while len(samples) > 1 and samples[1][0] <= now - WINDOW:
            samples.popleft()

    def window(self) -> Window:
        """The last minute (see the module docstring)."""
        self.sample()
        now = self.now()
        base_at, base = self._samples[0]
        for at, totals in self._samples:
            if at > now - WINDOW:
                break
            base_at, base = at, totals
        current = self.totals()
        return Window(now - base_at, {name: max(0, value - base.get(name, 0)) for name, value in current.items()})
