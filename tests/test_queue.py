"""Unit tests of :class:`crossbar.state.queue.RouteQueues` (docs/design.md §Choosing a host, rule 4)
and :func:`crossbar.proxy.modellist.route_models` (§The proxy, rule 10)."""

from __future__ import annotations

import json
from types import MappingProxyType
from typing import Callable

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from crossbar.config import Route
from crossbar.hosts.health import HostStatus
from crossbar.proxy.modellist import route_models
from crossbar.state.queue import RouteQueues


class Waiter:
    """A waiting request whose retry succeeds while ``room()`` says so for its model."""

    def __init__(self, name: str, route: str, queued_at: float, room: Callable[["Waiter"], bool],
                 log: list[str]) -> None:
        self.name = name
        self._route = route
        self._queued_at = queued_at
        self.room = room
        self.log = log
        self.retries = 0
        self.key = ""

    @property
    def route_name(self) -> str:
        return self._route

    @property
    def queued_at(self) -> float | None:
        return self._queued_at

    def retry(self) -> bool:
        self.retries += 1
        if self.room(self):
            self.log.append(self.name)
            return True
        return False


class RouteQueuesTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.queues = RouteQueues(self.clock.seconds)
        self.left: list[str] = []
        self.slots = 0

    def take_slot(self, waiter: Waiter) -> bool:
        if self.slots > 0:
            self.slots -= 1
            return True
        return False

    def add(self, name: str, route: str = "r", room: Callable[[Waiter], bool] | None = None) -> Waiter:
        waiter = Waiter(name, route, self.clock.seconds(), room or self.take_slot, self.left)
        self.queues.add(waiter)
        return waiter

    def test_arrival_order(self) -> None:
        for i in range(5):
            self.add(f"w{i}")
            self.clock.advance(1)
        self.assertEqual(self.queues.queued("r"), 5)
        self.assertEqual(self.queues.oldest_wait("r"), 5.0)
        self.slots = 2
        self.queues.wake()
        self.assertEqual(self.left, ["w0", "w1"])
        self.assertEqual(self.queues.queued("r"), 3)
        self.assertEqual(self.queues.oldest_wait("r"), 3.0)
        self.slots = 10
        self.queues.wake()
        self.assertEqual(self.left, ["w0", "w1", "w2", "w3", "w4"])
        self.assertEqual(len(self.queues), 0)
        self.assertIsNone(self.queues.oldest_wait("r"))

    def test_later_request_for_another_model_may_pass(self) -> None:
        full = self.add("big", room=lambda w: False)
        self.add("small", room=lambda w: True)
        self.queues.wake()
        self.assertEqual(self.left, ["small"])
        self.assertEqual([w for w in self.queues.waiters()], [full])

    def test_routes_are_separate(self) -> None:
        self.add("a1", route="a")
        self.add("b1", route="b")
        self.assertEqual((self.queues.queued("a"), self.queues.queued("b"), len(self.queues)), (1, 1, 2))
        self.assertTrue(self.queues.remove(self.queues.waiters()[0]))
        self.assertEqual((self.queues.queued("a"), self.queues.queued("b")), (0, 1))

    def test_reentrant_wake_is_folded(self) -> None:
        """A retry that wakes the queue (a dispatch freeing a slot at once) does not
        recurse: the nested wake becomes one more pass, which serves the next waiter."""
        depth = [0, 0]

        def frees_a_slot(waiter: Waiter) -> bool:
            depth[0] += 1
            depth[1] = max(depth[1], depth[0])
            self.slots += 1  # the request it dispatched ended at once
            self.queues.wake()
            depth[0] -= 1
            return True

        first = self.add("first", room=frees_a_slot)
        second = self.add("second")
        self.queues.wake()
        self.assertEqual(self.left, ["first", "second"])
        self.assertEqual(depth[1], 1)
        self.assertEqual((first.retries, second.retries), (1, 1))
        self.assertEqual(len(self.queues), 0)

    def test_remove(self) -> None:
        a = self.add("a")
        b = self.add("b")
        self.assertTrue(self.queues.remove(a))
        self.assertFalse(self.queues.remove(a))
        self.slots = 5
        self.queues.wake()
        self.assertEqual(self.left, ["b"])
        self.assertEqual(a.retries, 0)
        self.assertFalse(self.queues.remove(b))

    def test_removed_during_wake_is_skipped(self) -> None:
        """A waiter removed by an earlier one's retry (a timeout, a client gone) is not retried."""
        later: list[Waiter] = []

        def removes_next(waiter: Waiter) -> bool:
            self.queues.remove(later[0])
            return True

        self.add("first", room=removes_next)
        later.append(self.add("second", room=lambda w: True))
        self.queues.wake()
        self.assertEqual(later[0].retries, 0)
        self.assertEqual(len(self.queues), 0)


def entry(model: str, **extra: object) -> str:
    return json.dumps({"id": model, **extra})


def status(healthy: bool = True, loaded: tuple[str, ...] = (), loading: tuple[str, ...] = (),
           available: tuple[str, ...] = (), **entries: str) -> HostStatus:
    return HostStatus(healthy=healthy, loaded=loaded, loading=loading, available=available,
                      entries=MappingProxyType(entries))


class RouteModelsTests(SynchronousTestCase):
    def test_merged_sorted_with_hosts(self) -> None:
        route = Route("r", ("a", "b", "c"))
        table = {
            "a": status(loaded=("zeta",), available=("beta",), zeta=entry("zeta", owned_by="a"),
                        beta=entry("beta", owned_by="a")),
            "b": status(loaded=("beta",), loading=("alpha",), beta=entry("beta", owned_by="b"),
                        alpha=entry("alpha", owned_by="b")),
            "c": status(healthy=False, loaded=("gamma", "zeta"), gamma=entry("gamma")),
        }
        doc = route_models(route, table)
        assert doc is not None
        self.assertEqual(doc["object"], "list")
        self.assertEqual([e["id"] for e in doc["data"]], ["alpha", "beta", "zeta"])
        by_id = {e["id"]: e for e in doc["data"]}
        self.assertEqual(by_id["beta"]["owned_by"], "a")  # first listing host in route order
        self.assertEqual(by_id["beta"]["crossbar"], {"hosts": {"a": "available", "b": "loaded"}})
        self.assertEqual(by_id["alpha"]["crossbar"], {"hosts": {"b": "loading"}})
        self.assertEqual(by_id["zeta"]["crossbar"], {"hosts": {"a": "loaded"}})  # c is down

    def test_route_order_not_table_order(self) -> None:
        route = Route("r", ("b", "a"))
        table = {"a": status(loaded=("m",), m=entry("m", owned_by="a")),
                 "b": status(loaded=("m",), m=entry("m", owned_by="b"))}
        doc = route_models(route, table)
        assert doc is not None
        self.assertEqual(doc["data"][0]["owned_by"], "b")
        self.assertEqual(list(doc["data"][0]["crossbar"]["hosts"]), ["b", "a"])

    def test_hosts_of_other_routes_left_out(self) -> None:
        table = {"a": status(loaded=("m",)), "x": status(loaded=("other",))}
        doc = route_models(Route("r", ("a",)), table)
        assert doc is not None
        self.assertEqual(doc["data"], [{"id": "m", "crossbar": {"hosts": {"a": "loaded"}}}])

    def test_no_healthy_host_is_none(self) -> None:
        table = {"a": status(healthy=False, loaded=("m",))}
        self.assertIsNone(route_models(Route("r", ("a", "gone")), table))

    def test_healthy_host_with_no_models_is_an_empty_list(self) -> None:
        self.assertEqual(route_models(Route("r", ("a",)), {"a": status()}), {"object": "list", "data": []})

    def test_entry_does_not_override_crossbar_or_leak_between_calls(self) -> None:
        table = {"a": status(loaded=("m",), m=entry("m", crossbar="theirs"))}
        doc = route_models(Route("r", ("a",)), table)
        assert doc is not None
        self.assertEqual(doc["data"][0]["crossbar"], {"hosts": {"a": "loaded"}})
        again = route_models(Route("r", ("a",)), table)
        self.assertEqual(again, doc)

    def test_router_command_lines_never_reach_clients(self) -> None:
        """Issue 20 item 11: a router-mode host's ``status.args`` (its command line,
        absolute paths) and ``status.preset`` were passed to any client."""
        with open(__file__.replace("test_queue.py", "fixtures/llama_models_router.json"), "rb") as f:
            listed = json.load(f)["data"]
        entries = {e["id"]: json.dumps(e) for e in listed}
        table = {"a": status(loaded=tuple(entries), **entries)}
        doc = route_models(Route("r", ("a",)), table)
        assert doc is not None
        self.assertEqual(len(doc["data"]), len(listed))
        text = json.dumps(doc)
        self.assertNotIn("/root/", text)
        self.assertNotIn("--model", text)
        for got, host_said in zip(doc["data"], sorted(listed, key=lambda e: e["id"])):
            self.assertEqual(got["status"], {"value": host_said["status"]["value"]})
            self.assertEqual(got["architecture"], host_said["architecture"])  # the rest kept
        failed = {"m": entry("m", status={"value": "unloaded", "failed": True, "exit_code": 1, "args": ["/x"]})}
        doc = route_models(Route("r", ("a",)), {"a": status(available=("m",), **failed)})
        assert doc is not None
        self.assertEqual(doc["data"][0]["status"], {"value": "unloaded", "failed": True, "exit_code": 1})

class RouteModelAliasTests(SynchronousTestCase):
    """§Model names: exact aliases whose target a healthy host lists are in the list."""

    def test_exact_aliases_of_listed_targets(self) -> None:
        route = Route("r", ("a", "b"), aliases=MappingProxyType(
            {"gpt-4o": "m", "claude-*": "m", "ghost": "gone", "m2": "m", "z-alias": "n"}))
        table = {"a": status(loaded=("m",), m=entry("m", owned_by="a")),
                 "b": status(healthy=False, loaded=("n",)), }
        doc = route_models(route, table)
        assert doc is not None
        self.assertEqual([e["id"] for e in doc["data"]], ["gpt-4o", "m", "m2"])  # no glob, no unlisted target
        by_id = {e["id"]: e for e in doc["data"]}
        self.assertEqual(by_id["gpt-4o"]["owned_by"], "a")
        self.assertEqual(by_id["gpt-4o"]["crossbar"], {"alias_of": "m", "hosts": {"a": "loaded"}})
        self.assertEqual(by_id["m"]["crossbar"], {"hosts": {"a": "loaded"}})

    def test_a_real_id_wins_over_an_alias(self) -> None:
        route = Route("r", ("a",), aliases=MappingProxyType({"n": "m"}))
        table = {"a": status(loaded=("m", "n"))}
        doc = route_models(route, table)
        assert doc is not None
        self.assertEqual(doc["data"][1], {"id": "n", "crossbar": {"hosts": {"a": "loaded"}}})
