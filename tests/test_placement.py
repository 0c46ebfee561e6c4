"""Where models live: the decisions as pure functions, and the runtime's choice with the
loads crossbar caused (docs/design.md §Where models live, rules 1-5)."""

from __future__ import annotations

from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from crossbar.config import Host, PlacementSettings, Route, parse_config
from crossbar.hosts.balance import Chosen, Fit, Rotation, Verdict, choose
from crossbar.hosts.health import HostStatus
from crossbar.hosts.placement import (
    Placing, evicted, has_free_place, idle_models, keep_targets, least_recent, load_tier, model_id, with_loading,
)
from crossbar.state.runtime import Runtime
from tests.test_fit_router import router

HOSTS = {h: Host(name=h, url=f"http://127.0.0.1:{9000 + i}", models_max=2) for i, h in enumerate("abcd")}


def none_in_use(host: str, model: str) -> int:
    return 0


def never(host: str, model: str) -> float | None:
    return None


class DecisionTests(SynchronousTestCase):
    def test_free_place_counts_loaded_and_loading(self) -> None:
        self.assertTrue(has_free_place(HOSTS["a"], router(m1="loaded", m2="unloaded")))
        self.assertFalse(has_free_place(HOSTS["a"], router(m1="loaded", m2="loading", m3="unloaded")))
        unlimited = Host(name="a", url="http://127.0.0.1:1", models_max=0)
        self.assertTrue(has_free_place(unlimited, router(m1="loaded", m2="loaded", m3="loaded")))

    def test_least_recent_is_by_last_use_then_never_used_first(self) -> None:
        status = router(m1="loaded", m2="loaded", m3="unloaded")
        uses = {("a", "m1"): 10.0, ("a", "m2"): 5.0}
        self.assertEqual(least_recent("a", status, lambda h, m: uses.get((h, m))), "m2")
        uses[("a", "m2")] = 20.0
        self.assertEqual(least_recent("a", status, lambda h, m: uses.get((h, m))), "m1")
        self.assertEqual(least_recent("a", status, never), "m1")
        self.assertIsNone(least_recent("a", router(m1="unloaded"), never))

    def test_load_tier_free_place_first_then_idle_lru_never_busy(self) -> None:
        statuses = {
            "a": router(m1="loaded", m2="loaded", x="unloaded"),   # full, its LRU (m1) busy
            "b": router(m3="loaded", m4="loaded", x="unloaded"),   # full, its LRU (m3) idle
            "c": router(m5="loaded", x="unloaded"),                # a free place
        }
        uses = {("a", "m1"): 1.0, ("a", "m2"): 2.0, ("b", "m3"): 1.0, ("b", "m4"): 2.0}
        busy = {("a", "m1"): 1, ("b", "m4"): 3}
        in_use = lambda h, m: busy.get((h, m), 0)  # noqa: E731
        last = lambda h, m: uses.get((h, m))  # noqa: E731
        self.assertEqual(load_tier("abc", HOSTS, statuses, in_use, last), ["c"])
        self.assertEqual(load_tier("ab", HOSTS, statuses, in_use, last), ["b"])
        self.assertEqual(load_tier("a", HOSTS, statuses, in_use, last), [])

    def test_load_tier_never_evicts_a_model_kept_under_its_alias(self) -> None:
        """Rule 5: ``keep_loaded: [alias-of-b1]`` keeps b1 (the host reports the alias):
        a load never evicts it, as it never evicts a model kept by its id."""
        statuses = {h: router(**{f"{h}1": "loaded", f"{h}2": "loaded", "x": "unloaded"}) for h in "ab"}
        uses = {("a", "a1"): 8.0, ("a", "a2"): 9.0, ("b", "b1"): 3.0, ("b", "b2"): 9.0}
        last = lambda h, m: uses.get((h, m))  # noqa: E731
        self.assertEqual(load_tier("ab", HOSTS, statuses, none_in_use, last), ["b"])
        self.assertEqual(load_tier("ab", HOSTS, statuses, none_in_use, last, kept=("b1",)), ["a"])
        self.assertEqual(load_tier("ab", HOSTS, statuses, none_in_use, last, kept=("alias-of-b1",)), ["a"])

    def test_load_tier_evicts_the_model_asked_for_longest_ago(self) -> None:
        statuses = {h: router(**{f"{h}1": "loaded", f"{h}2": "loaded", "x": "unloaded"}) for h in "abc"}
        uses = {("a", "a1"): 8.0, ("a", "a2"): 9.0, ("b", "b1"): 3.0, ("b", "b2"): 9.0,
                ("c", "c1"): 5.0, ("c", "c2"): 6.0}
        last = lambda h, m: uses.get((h, m))  # noqa: E731
        self.assertEqual(load_tier("abc", HOSTS, statuses, none_in_use, last), ["b"])
        busy = lambda h, m: int((h, m) == ("b", "b1"))  # noqa: E731
        self.assertEqual(load_tier("abc", HOSTS, statuses, busy, last), ["c"])  # b's LRU in use: c's next
        uses[("a", "a1")] = 5.0  # a tie: both, rule 3 chooses
        self.assertEqual(load_tier("abc", HOSTS, statuses, busy, last), ["a", "c"])
        del uses[("c", "c1")]  # never sent a request: the oldest
        self.assertEqual(load_tier("abc", HOSTS, statuses, busy, last), ["c"])

    def test_a_model_with_requests_waiting_is_not_evicted(self) -> None:
        statuses = {"a": router(m1="loaded", m2="loaded", x="unloaded")}
        uses = {("a", "m1"): 1.0, ("a", "m2"): 2.0}
        last = lambda h, m: uses.get((h, m))  # noqa: E731
        self.assertEqual(load_tier("a", HOSTS, statuses, none_in_use, last), ["a"])
        self.assertEqual(load_tier("a", HOSTS, statuses, none_in_use, last, waiting=lambda m: m == "m1"), [])
        self.assertEqual(load_tier("a", HOSTS, statuses, none_in_use, last, kept=("m1",)), [])

    def test_evicted_is_the_lru_of_a_full_host(self) -> None:
        full = router(m1="loaded", m2="loaded", x="unloaded")
        self.assertEqual(evicted("a", HOSTS["a"], full, lambda h, m: {"m1": 5.0, "m2": 1.0}[m]), "m2")
        self.assertIsNone(evicted("a", HOSTS["a"], router(m1="loaded", x="unloaded"), never))

    def test_with_loading_counts_the_eviction_as_unloaded(self) -> None:
        status = with_loading(router(m1="loaded", m2="loaded", x="unloaded"), ["x"], ["m2"])
        self.assertEqual((status.loaded, status.loading, status.available), (("m1",), ("x",), ("m2",)))

    def test_with_loading_moves_available_to_loading(self) -> None:
        status = with_loading(router(m1="loaded", m2="unloaded"), ["m2", "m9"])
        self.assertEqual((status.loaded, status.loading, status.available), (("m1",), ("m2",), ()))
        same = router(m1="loaded")
        self.assertIs(with_loading(same, ["m1"]), same)

    def test_model_id_by_alias(self) -> None:
        status = router(m1="unloaded")
        self.assertEqual(model_id(status, "alias-of-m1"), "m1")
        self.assertEqual(model_id(status, "m1"), "m1")

    def test_idle_models(self) -> None:
        status = router(m1="loaded", m2="loaded", m3="loaded", m4="loaded")
        uses = {("a", "m1"): 0.0, ("a", "m2"): 50.0, ("a", "m3"): 0.0}
        busy = {("a", "m3"): 1}
        idle = idle_models("a", status, 100, {"m4"}, 120.0, lambda h, m: busy.get((h, m), 0),
                           lambda h, m: uses.get((h, m), 0.0))
        self.assertEqual(idle, ["m1"])  # m2 used lately, m3 in flight, m4 kept
        self.assertEqual(idle_models("a", router(m1="loaded"), 100, (), 500.0, none_in_use, never), [])

    def test_keep_targets(self) -> None:
        route = Route(name="r", hosts=("a", "b", "c"), placement=PlacementSettings(keep_loaded=("k1", "k2", "k3")))
        statuses = {
            "a": router(k1="loaded", k2="unloaded", k3="unloaded", m="loaded"),
            "b": router(k1="unloaded", k2="unloaded", k3="unloaded"),
            "c": router(k1="unloaded", k2="unloaded", k3="unloaded"),
        }
        load = {"a": 0, "b": 3, "c": 0}
        targets = keep_targets(route, HOSTS, statuses, (), lambda h: load[h], none_in_use, never)
        # k1 is loaded on a; k2 goes to the least busy host with a free place; k3 to another host
        self.assertEqual(targets, [("k2", "c"), ("k3", "b")])
        self.assertEqual(keep_targets(route, HOSTS, statuses, ("b", "c"), lambda h: 0, none_in_use, never), [])
        down = dict(statuses, a=HostStatus(healthy=False, polled=True))
        self.assertEqual([m for m, _ in keep_targets(route, HOSTS, down, (), lambda h: 0, none_in_use, never)],
                         ["k1", "k2"])


def pick(statuses: dict[str, HostStatus], model: str, placing: Placing | None, inflight: Any = None,
         hosts: dict[str, Host] | None = None) -> Chosen | Verdict:
    route = Route(name="r", hosts=tuple(statuses), placement=PlacementSettings())
    return choose(route, hosts or HOSTS, statuses, inflight or (lambda h: 0), model, None, Rotation(),
                  placement=placing)


class ChooseTests(SynchronousTestCase):
    def test_available_tier_keeps_the_hosts_rule_2_allows(self) -> None:
        statuses = {"a": router(m1="loaded", m2="loaded", x="unloaded"), "b": router(m3="loaded", x="unloaded")}
        busy = {("a", "m1"): 1, ("a", "m2"): 1}
        chosen = pick(statuses, "x", Placing(lambda h, m: busy.get((h, m), 0), never))
        assert isinstance(chosen, Chosen)
        self.assertEqual((chosen.host, chosen.fit, chosen.load), ("b", Fit.AVAILABLE, "load"))
        self.assertIn("available load least-busy", chosen.why)

    def test_every_host_busy_waits_rather_than_evict(self) -> None:
        statuses = {"a": router(m1="loaded", m2="loaded", x="unloaded")}
        self.assertIs(pick(statuses, "x", Placing(lambda h, m: 1, never)), Verdict.BUSY)
        # without placement the router would evict: crossbar sends it
        chosen = pick(statuses, "x", None)
        assert isinstance(chosen, Chosen)
        self.assertEqual(chosen.load, "")

    def test_spread_after_waiting(self) -> None:
        limited = {h: Host(name=h, url=f"http://127.0.0.1:{9000 + i}", max_inflight=1, models_max=2)
                   for i, h in enumerate("ab")}
        statuses = {"a": router(x="loaded"), "b": router(x="unloaded")}
        inflight = {"a": 1, "b": 0}
        self.assertIs(pick(statuses, "x", Placing(none_in_use, never), lambda h: inflight[h], limited), Verdict.BUSY)
        chosen = pick(statuses, "x", Placing(none_in_use, never, spread=True), lambda h: inflight[h], limited)
        assert isinstance(chosen, Chosen)
        self.assertEqual((chosen.host, chosen.fit, chosen.load), ("b", Fit.AVAILABLE, "spread"))
        # a copy already under way takes the spread before another host loads one
        three = dict(limited, c=Host(name="c", url="http://127.0.0.1:9100", max_inflight=1, models_max=2))
        loading = {"a": router(x="loaded"), "b": router(x="unloaded"), "c": router(x="loading")}
        chosen = pick(loading, "x", Placing(none_in_use, never, spread=True), lambda h: {"a": 1}.get(h, 0), three)
        assert isinstance(chosen, Chosen)
        self.assertEqual((chosen.host, chosen.fit, chosen.load), ("c", Fit.LOADING, ""))
        # a copy under way without room: wait for it, no third copy (one load at a time)
        full = {"a": 1, "c": 1}
        self.assertIs(pick(loading, "x", Placing(none_in_use, never, spread=True), lambda h: full.get(h, 0), three),
                      Verdict.BUSY)
        # a request waiting for a model loading nowhere else but one host: no spread either
        only = {"b": router(x="unloaded"), "c": router(x="loading")}
        self.assertIs(pick(only, "x", Placing(none_in_use, never, spread=True), lambda h: full.get(h, 0), three),
                      Verdict.BUSY)
        inflight["a"] = 0  # room at the loaded host: no spread
        chosen = pick(statuses, "x", Placing(none_in_use, never, spread=True), lambda h: inflight[h], limited)
        assert isinstance(chosen, Chosen)
        self.assertEqual((chosen.host, chosen.load), ("a", ""))


CONFIG = """
listen: "tcp:0"
timeouts: {first_byte: 60}
hosts:
  a: {url: "http://127.0.0.1:9001", models_max: 2}
  b: {url: "http://127.0.0.1:9002", models_max: 2}
  c: {url: "http://127.0.0.1:9003", models_max: 2}
routes:
  r:
    hosts: [a, b, c]
    placement: {spread_after: 5}
"""


class RuntimeTests(SynchronousTestCase):
    """Rule 1 through :meth:`Runtime.choose`: the chosen host counts as loading at once."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.runtime = Runtime(parse_config(CONFIG), self.clock.seconds)
        for h in "abc":
            self.runtime.table.record_success(h, _listed(x="unloaded", y="unloaded"))
        self.route = self.runtime.config.routes["r"]

    def test_a_load_on_a_full_host_counts_its_lru_as_unloaded_at_once(self) -> None:
        for h in "abc":
            self.runtime.table.record_success(h, _listed(x="loaded", y="loaded", z="unloaded"))
        self.runtime.config.hosts  # models_max 2: every host is full; x was used, y never
        self.runtime.placement.used("a", "x")
        first = self.runtime.choose(self.route, "z", None, [])
        assert isinstance(first, Chosen)
        seen = self.runtime.placement.overlay(self.runtime.table.all())[first.host]
        self.assertEqual((seen.loaded, seen.loading), (("x",), ("z",)))

    def test_a_burst_for_a_model_loaded_nowhere_goes_to_one_host(self) -> None:
        chosen = [self.runtime.choose(self.route, "x", None, []) for _ in range(20)]
        hosts = {c.host for c in chosen if isinstance(c, Chosen)}
        self.assertEqual(len(hosts), 1, chosen)
        self.assertEqual([c.load for c in chosen if isinstance(c, Chosen)], ["load"] + [""] * 19)
        self.assertEqual(chosen[1].fit if isinstance(chosen[1], Chosen) else None, Fit.LOADING)
        (host,) = hosts
        self.assertEqual(self.runtime.placement.last_load[host].reason, "request")

    def test_the_mark_ends_with_a_poll(self) -> None:
        first = self.runtime.choose(self.route, "x", None, [])
        assert isinstance(first, Chosen)
        placement = self.runtime.placement
        loaded: list[tuple[str, str, float]] = []
        placement.on_loaded = lambda h, m, s: loaded.append((h, m, s))
        # a poll that started before the load says nothing of it
        placement.polled(first.host, self.runtime.table.get(first.host), started=-1)  # type: ignore[arg-type]
        self.assertIn((first.host, "x"), placement.loading)
        self.clock.advance(3)
        self.runtime.table.record_success(first.host, _listed(x="loaded", y="unloaded"))
        placement.polled(first.host, self.runtime.table.get(first.host), started=2)  # type: ignore[arg-type]
        self.assertEqual(placement.loading, {})
        self.assertEqual(loaded, [(first.host, "x", 3.0)])

    def test_a_failed_load_ends_the_mark(self) -> None:
        first = self.runtime.choose(self.route, "x", None, [])
        assert isinstance(first, Chosen)
        self.clock.advance(1)
        self.runtime.placement.polled(first.host, self.runtime.table.get(first.host), started=0.5)  # type: ignore[arg-type]
        self.assertEqual(self.runtime.placement.loading, {})

    def test_a_load_waiting_in_the_hosts_queue_keeps_the_mark(self) -> None:
        """llama-server lists a model unloaded while a request for it waits in the host's
        own queue for a place: while crossbar has such a request in flight, the model
        still counts as loading there (rule 1); once none is, the poll ends the mark."""
        first = self.runtime.choose(self.route, "x", None, [])
        assert isinstance(first, Chosen)
        in_flight = {(first.host, "x"): 1}
        self.clock.advance(1)
        placement = self.runtime.placement
        status = self.runtime.table.get(first.host)
        assert status is not None
        placement.polled(first.host, status, started=0.5, in_use=lambda h, m: in_flight.get((h, m), 0))
        self.assertIn((first.host, "x"), placement.loading)
        self.assertEqual(self.runtime.choose(self.route, "x", None, []).host, first.host)  # type: ignore[union-attr]
        in_flight.clear()  # the host answered it (a failed load ends its waiters with an error)
        placement.polled(first.host, status, started=0.5, in_use=lambda h, m: in_flight.get((h, m), 0))
        self.assertEqual(placement.loading, {})

    def test_the_mark_expires_after_first_byte(self) -> None:
        self.runtime.choose(self.route, "x", None, [])
        self.clock.advance(59)
        self.assertEqual(self.runtime.placement.expire(60), [])
        self.clock.advance(1)
        self.assertEqual(len(self.runtime.placement.expire(60)), 1)

    def test_a_model_being_unloaded_gets_no_request_there(self) -> None:
        """Rule 4: from the unload command until a later poll shows the model gone, the
        host counts it as not loaded: a request for it goes to another host holding it
        (not into the unload, which would cut it), and the mark ends with that poll."""
        for h in "ab":
            self.runtime.table.record_success(h, _listed(x="loaded", y="unloaded"))
        placement = self.runtime.placement
        self.clock.advance(1)
        placement.unloading_started("a", "x")
        for _ in range(4):
            chosen = self.runtime.choose(self.route, "x", None, [])
            self.assertEqual(chosen.host, "b")  # type: ignore[union-attr]
        self.clock.advance(0.1)
        placement.unloaded("a", "x", "idle")  # the command succeeded at 1.1
        status = self.runtime.table.get("a")
        assert status is not None
        placement.polled("a", status, started=1.05)  # a poll from before it ended says nothing
        self.assertIn(("a", "x"), placement.unloading)
        self.runtime.table.record_success("a", _listed(x="unloaded", y="unloaded"))
        placement.polled("a", self.runtime.table.get("a"), started=1.2)  # type: ignore[arg-type]
        self.assertEqual(placement.unloading, {})

    def test_a_model_being_unloaded_on_its_only_host_makes_the_request_wait(self) -> None:
        """Rule 4: no other host lists the model: the request waits (it is not sent to
        load the model into the host's unload, which would cut it), then loads it there
        once a poll shows it gone."""
        self.runtime.table.record_success("a", _listed(x="loaded", y="unloaded"))
        for h in "bc":
            self.runtime.table.record_success(h, _listed(y="unloaded"))
        placement = self.runtime.placement
        self.clock.advance(1)
        placement.unloading_started("a", "x")
        self.assertIs(self.runtime.choose(self.route, "x", None, []), Verdict.BUSY)
        placement.unloaded("a", "x", "idle")
        self.assertIs(self.runtime.choose(self.route, "x", None, []), Verdict.BUSY)
        self.runtime.table.record_success("a", _listed(x="unloaded", y="unloaded"))
        placement.polled("a", self.runtime.table.get("a"), started=1.0)  # type: ignore[arg-type]
        chosen = self.runtime.choose(self.route, "x", None, [])
        self.assertEqual((chosen.host, chosen.load), ("a", "load"))  # type: ignore[union-attr]

    def test_a_host_that_keeps_the_model_after_the_unload_ends_the_mark_at_its_second_poll(self) -> None:
        """Rule 4: a host that answered the unload but still lists the model loaded (it
        stops it for a moment first, or it kept it, or loaded it again) holds it away
        for two polls after the answer, not until ``timeouts.first_byte``."""
        self.runtime.table.record_success("a", _listed(x="loaded", y="unloaded"))
        placement = self.runtime.placement
        self.clock.advance(1)
        placement.unloading_started("a", "x")
        status = self.runtime.table.get("a")
        assert status is not None
        placement.polled("a", status, started=1.0)  # in flight: a poll still listing it says nothing
        self.clock.advance(0.1)
        placement.unloaded("a", "x", "idle")
        placement.polled("a", status, started=1.05)  # started before the answer
        placement.polled("a", status, started=1.2)  # the first after it: maybe still stopping
        self.assertIn(("a", "x"), placement.unloading)
        placement.polled("a", status, started=1.3)
        self.assertEqual(placement.unloading, {})
        self.assertEqual(self.runtime.choose(self.route, "x", None, []).host, "a")  # type: ignore[union-attr]

    def test_a_failed_unload_or_the_bound_ends_the_unloading_mark(self) -> None:
        placement = self.runtime.placement
        placement.unloading_started("a", "x")
        placement.unloading_ended("a", "x")
        self.assertEqual(placement.unloading, {})
        placement.unloading_started("a", "x")
        self.clock.advance(60)
        placement.expire(60)
        self.assertEqual(placement.unloading, {})


def _listed(**states: str) -> Any:
    from tests.test_fit_router import router as r
    s = r(**states)
    from crossbar.hosts.models import ModelList
    return ModelList(loaded=s.loaded, loading=s.loading, available=s.available, entries=s.entries,
                     router=s.router, aliases=s.aliases)


class _Waiter:
    def __init__(self, model: str | None) -> None:
        self.route_name, self.queued_at, self.model, self.key = "r", 0.0, model, ""

    def retry(self) -> bool:
        return False


class WaitingForTests(SynchronousTestCase):
    def test_the_queues_count_the_models_waited_for(self) -> None:
        from crossbar.state.queue import RouteQueues
        queues = RouteQueues(lambda: 0.0)
        waiters = [_Waiter("m1"), _Waiter("m1"), _Waiter(None)]
        for w in waiters:
            queues.add(w)
        self.assertEqual((queues.waiting_for("m1"), queues.waiting_for("m2")), (2, 0))
        queues.remove(waiters[0])
        queues.remove(waiters[0])  # not in it any more: counts nothing
        self.assertEqual(queues.waiting_for("m1"), 1)


class PlacerTicksTests(SynchronousTestCase):
    """The placer's ticks (a spread due, a load expired) run only while some route has
    ``placement``: a fleet without it pays no timer (each wake-up of the reactor costs
    CPU), and a reload that adds or removes ``placement`` starts or stops them."""

    def test_ticks_only_with_placement(self) -> None:
        from crossbar.state.placer import TICK, Placer

        clock = Clock()
        without = CONFIG.replace("    placement: {spread_after: 5}\n", "")
        runtime = Runtime(parse_config(without, "c.yaml", {}), clock.seconds)
        placer = Placer(runtime, commands=None, clock=clock)  # type: ignore[arg-type]
        placer.start()
        self.assertEqual(clock.getDelayedCalls(), [])
        runtime.reconfigure(parse_config(CONFIG, "c.yaml", {}))
        placer.start()
        self.assertEqual([round(c.getTime() - clock.seconds(), 6) for c in clock.getDelayedCalls()], [TICK])
        placer.start()  # again: still one
        self.assertEqual(len(clock.getDelayedCalls()), 1)
        runtime.reconfigure(parse_config(without, "c.yaml", {}))
        placer.start()
        self.assertEqual(clock.getDelayedCalls(), [])
        runtime.reconfigure(parse_config(CONFIG, "c.yaml", {}))
        placer.start()
        placer.stop()
        self.assertEqual(clock.getDelayedCalls(), [])
