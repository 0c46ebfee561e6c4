"""Property tests of :func:`crossbar.hosts.balance.choose` (docs/design.md §Choosing a host, rules 1-3).

Each example is a route over a few hosts with random health, model states, weights,
``max_inflight`` limits, in-flight counts, exclusions and a primary; the properties are
the rules themselves, checked against the inputs rather than a copy of the code.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from crossbar.hosts.balance import Chosen, Fit, Rotation, Verdict, choose, fit_tier, has_room
from crossbar.config import Host, Route
from crossbar.hosts.health import HostStatus

MODELS = ("m1", "m2")
NAMES = ("h0", "h1", "h2", "h3", "h4")


@dataclass(frozen=True)
class Case:
    """One generated situation."""

    route: Route
    hosts: dict[str, Host]
    statuses: dict[str, HostStatus]
    load: dict[str, int]
    model: str | None
    exclude: tuple[str, ...]

    def inflight(self, host: str) -> int:
        return self.load.get(host, 0)

    def run(self, rotation: Rotation | None = None) -> Chosen | Verdict:
        return choose(self.route, self.hosts, self.statuses, self.inflight, self.model, None,
                      rotation or Rotation(), self.exclude)

    def candidates(self) -> list[str]:
        """Healthy, untried hosts in route order."""
        return [h for h in self.route.hosts if h not in self.exclude and self.statuses[h].healthy]

    def unpolled(self) -> list[str]:
        """Untried hosts whose first poll has not finished (new, or reset by a reload)."""
        return [h for h in self.route.hosts if h not in self.exclude and not self.statuses[h].polled]

    def fit_of(self, host: str) -> Fit:
        status = self.statuses[host]
        if self.model in status.loaded:
            return Fit.LOADED
        if self.model in status.loading:
            return Fit.LOADING
        if self.model in status.available:
            return Fit.AVAILABLE
        return Fit.FALLBACK

    def best_fit(self) -> Fit | None:
        fits = [self.fit_of(h) for h in self.candidates()]
        order = list(Fit)
        return min(fits, key=order.index) if fits else None


@st.composite
def statuses(draw: st.DrawFn) -> HostStatus:
    states = {m: draw(st.sampled_from(("loaded", "loading", "available", "absent"))) for m in MODELS}
    pick = lambda s: tuple(sorted(m for m, v in states.items() if v == s))  # noqa: E731
    healthy = draw(st.booleans())
    return HostStatus(healthy=healthy, loaded=pick("loaded"), loading=pick("loading"),
                      available=pick("available"), polled=healthy or draw(st.booleans()))


@st.composite
def cases(draw: st.DrawFn) -> Case:
    n = draw(st.integers(1, len(NAMES)))
    names = draw(st.permutations(NAMES[:n]))
    hosts = {
        h: Host(h, f"http://127.0.0.1:{9000 + i}", weight=draw(st.sampled_from((0.5, 1.0, 2.0, 3.0))),
                max_inflight=draw(st.one_of(st.none(), st.integers(1, 4))))
        for i, h in enumerate(names)
    }
    primary = draw(st.one_of(st.none(), st.sampled_from(names)))
    route = Route("r", tuple(names), primary=primary)
    return Case(
        route=route,
        hosts=hosts,
        statuses={h: draw(statuses()) for h in names},
        load={h: draw(st.integers(0, 5)) for h in names},
        model=draw(st.one_of(st.none(), st.sampled_from(MODELS))),
        exclude=tuple(draw(st.sets(st.sampled_from(names), max_size=n))),
    )


class ChooseProperties(SynchronousTestCase):
    """Every rule of §Choosing a host 1-3, over random fleets."""

    @settings(max_examples=250, deadline=None)
    @given(cases())
    def test_never_unhealthy_or_excluded(self, case: Case) -> None:
        got = case.run()
        if isinstance(got, Chosen):
            self.assertTrue(case.statuses[got.host].healthy)
            self.assertNotIn(got.host, case.exclude)
            self.assertIn(got.host, case.route.hosts)
        elif not case.candidates():
            self.assertIs(got, Verdict.BUSY if case.unpolled() else Verdict.NO_HOST)

    @settings(max_examples=250, deadline=None)
    @given(cases())
    def test_no_host_only_when_none_left(self, case: Case) -> None:
        """503 only when no host is healthy and none is still to be polled (a host not
        polled yet, e.g. reset by a reload, is waited for: BUSY)."""
        got = case.run()
        self.assertEqual(got is Verdict.NO_HOST, not case.candidates() and not case.unpolled())

    @settings(max_examples=250, deadline=None)
    @given(cases())
    def test_best_tier_only_even_when_full(self, case: Case) -> None:
        """Load never pushes a request to a worse tier: the best tier full is BUSY."""
        got = case.run()
        best = case.best_fit()
        if best is None:
            return
        best_hosts = [h for h in case.candidates() if case.fit_of(h) is best]
        roomy = [h for h in best_hosts if has_room(case.hosts[h], case.inflight(h))]
        if isinstance(got, Chosen):
            self.assertIs(case.fit_of(got.host), best)
            self.assertIs(got.fit, best)
        else:
            self.assertIs(got, Verdict.BUSY)
            self.assertEqual(roomy, [])
        if roomy:
            self.assertIsInstance(got, Chosen)

    @settings(max_examples=250, deadline=None)
    @given(cases())
    def test_never_at_or_above_max_inflight(self, case: Case) -> None:
        got = case.run()
        if isinstance(got, Chosen):
            limit = case.hosts[got.host].max_inflight
            if limit is not None:
                self.assertLess(case.inflight(got.host), limit)

    @settings(max_examples=250, deadline=None)
    @given(cases())
    def test_primary_first_while_in_tier_with_room(self, case: Case) -> None:
        got = case.run()
        primary = case.route.primary
        if not isinstance(got, Chosen) or primary is None:
            return
        eligible = (
            primary in case.candidates()
            and case.fit_of(primary) is got.fit
            and has_room(case.hosts[primary], case.inflight(primary))
        )
        self.assertEqual(got.host == primary and got.pick == "primary", eligible)

    @settings(max_examples=250, deadline=None)
    @given(cases())
    def test_least_busy_otherwise(self, case: Case) -> None:
        got = case.run()
        if not isinstance(got, Chosen) or got.pick == "primary":
            return
        self.assertEqual(got.pick, "least-busy")
        self.assertEqual(got.why, f"{got.fit.value} least-busy affinity=none")
        score = lambda h: (case.inflight(h) + 1) / case.hosts[h].weight  # noqa: E731
        rivals = [
            h for h in case.candidates()
            if case.fit_of(h) is got.fit and has_room(case.hosts[h], case.inflight(h))
        ]
        self.assertEqual(score(got.host), min(score(h) for h in rivals))

    @settings(max_examples=200, deadline=None)
    @given(cases())
    def test_fit_tier_matches_best_fit(self, case: Case) -> None:
        if not case.candidates():
            return
        fit, tier = fit_tier(case.candidates(), case.model, case.statuses)
        self.assertIs(fit, case.best_fit())
        self.assertEqual(tier, [h for h in case.candidates() if case.fit_of(h) is fit])


class Ties(SynchronousTestCase):
    """Exact ties rotate: idle equal hosts take turns."""

    @settings(max_examples=100, deadline=None)
    @given(n=st.integers(1, 5), k=st.integers(1, 6), load=st.integers(0, 3), weight=st.sampled_from((0.5, 1.0, 2.0)))
    def test_equal_hosts_take_turns(self, n: int, k: int, load: int, weight: float) -> None:
        names = NAMES[:n]
        route = Route("r", names)
        hosts = {h: Host(h, "http://127.0.0.1:1", weight=weight) for h in names}
        table = {h: HostStatus(healthy=True, loaded=("m1",)) for h in names}
        rotation = Rotation()
        picks = []
        for _ in range(k * n):
            got = choose(route, hosts, table, lambda h: load, "m1", None, rotation)
            assert isinstance(got, Chosen)
            picks.append(got.host)
        self.assertEqual({h: picks.count(h) for h in names}, {h: k for h in names})
        # consecutive windows of n calls cover every host once
        for i in range(0, k * n, n):
            self.assertEqual(sorted(picks[i:i + n]), sorted(names))

    def test_rotation_is_per_route(self) -> None:
        names = ("a", "b")
        hosts = {h: Host(h, "http://127.0.0.1:1") for h in names}
        table = {h: HostStatus(healthy=True) for h in names}
        rotation = Rotation()
        r1, r2 = Route("r1", names), Route("r2", names)
        first = [choose(r, hosts, table, lambda h: 0, None, None, rotation) for r in (r1, r2, r1, r2)]
        self.assertEqual([c.host for c in first if isinstance(c, Chosen)], ["a", "a", "b", "b"])

    def test_busier_host_is_not_a_tie(self) -> None:
        names = ("a", "b")
        hosts = {h: Host(h, "http://127.0.0.1:1") for h in names}
        table = {h: HostStatus(healthy=True) for h in names}
        rotation = Rotation()
        load = {"a": 1, "b": 0}
        for _ in range(4):
            got = choose(Route("r", names), hosts, table, load.__getitem__, None, None, rotation)
            self.assertEqual(got, Chosen("b", Fit.FALLBACK, "least-busy"))

    def test_weighted_split(self) -> None:
        """Filling from idle, weights 2:1 give 2:1 (least (in-flight+1)/weight)."""
        names = ("a", "b")
        hosts = {"a": Host("a", "http://127.0.0.1:1", weight=2.0), "b": Host("b", "http://127.0.0.1:2")}
        table = {h: HostStatus(healthy=True) for h in names}
        load = {"a": 0, "b": 0}
        rotation = Rotation()
        for _ in range(12):
            got = choose(Route("r", names), hosts, table, load.__getitem__, None, None, rotation)
            assert isinstance(got, Chosen)
            load[got.host] += 1
        self.assertEqual(load, {"a": 8, "b": 4})


class FirstPollTests(SynchronousTestCase):
    """A new or restarted worker answers neither ``model not found`` nor ``no healthy
    host`` while a host of the route has not had its first poll: the request waits
    (BUSY) for it (docs/design.md §Several crossbars, last bullet)."""

    ROUTER = HostStatus(healthy=True, polled=True, router=True, available=("other",))
    SINGLE = HostStatus(healthy=True, polled=True, loaded=("m1",))

    def setUp(self) -> None:
        self.route = Route("r", ("router", "single"))
        self.hosts = {h: Host(h, "http://127.0.0.1:1") for h in self.route.hosts}

    def run_choose(self, statuses: dict[str, HostStatus], exclude: tuple[str, ...] = ()) -> Chosen | Verdict:
        return choose(self.route, self.hosts, statuses, lambda h: 0, "m1", None, Rotation(), exclude)

    def test_router_polled_first_waits_for_the_others(self) -> None:
        """The soak's case: the router-mode host answered its first poll before the
        host that serves the model; the request waits, it is not 404."""
        got = self.run_choose({"router": self.ROUTER, "single": HostStatus()})
        self.assertIs(got, Verdict.BUSY)

    def test_dispatched_once_the_poll_lands(self) -> None:
        got = self.run_choose({"router": self.ROUTER, "single": self.SINGLE})
        self.assertEqual(got, Chosen("single", Fit.LOADED, "least-busy"))

    def test_model_not_found_once_every_host_was_polled(self) -> None:
        unhealthy = HostStatus(polled=True, failures=1, last_err="health: HTTP 503")
        self.assertIs(self.run_choose({"router": self.ROUTER, "single": unhealthy}), Verdict.NO_MODEL)

    def test_an_excluded_unpolled_host_is_not_waited_for(self) -> None:
        got = self.run_choose({"router": self.ROUTER, "single": HostStatus()}, exclude=("single",))
        self.assertIs(got, Verdict.NO_HOST)

    def test_no_healthy_host_waits_too(self) -> None:
        failed = HostStatus(polled=True, failures=1, last_err="health: HTTP 503")
        self.assertIs(self.run_choose({"router": failed, "single": HostStatus()}), Verdict.BUSY)

    @settings(max_examples=250, deadline=None)
    @given(cases(), st.lists(st.booleans(), min_size=5, max_size=5))
    def test_never_a_refusal_while_a_host_awaits_its_first_poll(self, case: Case, router: list[bool]) -> None:
        """Over random fleets with router-mode hosts: NO_MODEL and NO_HOST only when
        every untried host of the route has had its first poll."""
        statuses = {h: replace(s, router=r) for (h, s), r in zip(case.statuses.items(), router)}
        got = replace(case, statuses=statuses).run()
        if got in (Verdict.NO_MODEL, Verdict.NO_HOST):
            self.assertEqual(case.unpolled(), [])
