"""Fit with router-mode hosts and host-reported aliases (docs/design.md §Choosing a host
rule 1, §Model names): a router-mode host never takes the fallback tier, a host-reported
alias fits like its id, and a route whose healthy hosts are all in router mode answers
404 ``model not found`` for a model none lists."""

from __future__ import annotations

import json
from types import MappingProxyType

from twisted.trial.unittest import SynchronousTestCase

from crossbar.config import Host, Route
from crossbar.hosts.balance import Chosen, Fit, Rotation, Verdict, choose
from crossbar.hosts.health import HealthTable, HostStatus
from crossbar.hosts.models import parse_models

SINGLE = HostStatus(healthy=True, polled=True, loaded=("tiny-a",))


def router(**states: str) -> HostStatus:
    """A router-mode host's status as its real /v1/models answer gives it."""
    body = json.dumps({"data": [
        {"id": m, "aliases": ["alias-of-" + m], "status": {"value": v, "args": ["llama-server"]}}
        for m, v in states.items()
    ]}).encode()
    listed = parse_models(body)
    return HostStatus(healthy=True, polled=True, loaded=listed.loaded, loading=listed.loading,
                      available=listed.available, entries=listed.entries, router=listed.router,
                      aliases=listed.aliases)


def pick(statuses: dict[str, HostStatus], model: str | None, exclude: tuple[str, ...] = ()) -> Chosen | Verdict:
    route = Route(name="r", hosts=tuple(statuses))
    hosts = {h: Host(name=h, url=f"http://127.0.0.1:{9000 + i}") for i, h in enumerate(statuses)}
    return choose(route, hosts, statuses, lambda h: 0, model, None, Rotation(), exclude)


class ParseTests(SynchronousTestCase):
    def test_router_mode_and_reported_aliases(self) -> None:
        listed = parse_models(json.dumps({"data": [
            {"id": "a", "aliases": ["x", "", 3, "b"], "status": {"value": "loaded"}},
            {"id": "b", "aliases": ["x", "y"], "status": {"value": "unloaded"}},
        ]}).encode())
        self.assertTrue(listed.router)
        # an id wins over an alias ("b"), the first alias wins ("x"), junk is dropped
        self.assertEqual(dict(listed.aliases), {"x": "a", "y": "b"})

    def test_single_model_host_is_not_router(self) -> None:
        listed = parse_models(b'{"data": [{"id": "tiny-a", "object": "model"}]}')
        self.assertFalse(listed.router)
        self.assertEqual(dict(listed.aliases), {})


class FitTests(SynchronousTestCase):
    def test_unknown_model_on_a_mixed_route_goes_to_the_single_model_host(self) -> None:
        statuses = {"router": router(**{"tiny-a": "loaded"}), "single": SINGLE}
        for _ in range(12):  # never to the router, which would answer 400
            chosen = pick(statuses, "claude-sonnet-4-5")
            assert isinstance(chosen, Chosen)
            self.assertEqual((chosen.host, chosen.fit), ("single", Fit.FALLBACK))

    def test_only_router_hosts_and_an_unlisted_model_is_not_found(self) -> None:
        statuses = {"r1": router(**{"tiny-a": "loaded"}), "r2": router(**{"tiny-b": "unloaded"})}
        self.assertIs(pick(statuses, "gpt-4o"), Verdict.NO_MODEL)

    def test_after_a_failover_no_model_left_is_no_host(self) -> None:
        statuses = {"single": SINGLE, "r1": router(**{"tiny-a": "loaded"})}
        self.assertIs(pick(statuses, "gpt-4o", exclude=("single",)), Verdict.NO_HOST)

    def test_a_host_reported_alias_fits_like_its_id(self) -> None:
        statuses = {"single": SINGLE, "r1": router(**{"tiny-b": "unloaded"})}
        chosen = pick(statuses, "alias-of-tiny-b")
        assert isinstance(chosen, Chosen)
        self.assertEqual((chosen.host, chosen.fit), ("r1", Fit.AVAILABLE))

    def test_no_model_keeps_every_candidate(self) -> None:
        statuses = {"r1": router(**{"tiny-a": "loaded"})}
        chosen = pick(statuses, None)
        assert isinstance(chosen, Chosen)
        self.assertEqual(chosen.host, "r1")

    def test_health_table_keeps_router_and_aliases(self) -> None:
        table = HealthTable(["r"], recovery_polls=1, failure_threshold=1, now=lambda: 0.0)
        table.record_success("r", parse_models(b'{"data": [{"id": "m", "aliases": ["n"], "status": {"value": "loaded"}}]}'))
        status = table.get("r")
        assert status is not None
        self.assertTrue(status.router)
        self.assertEqual(dict(status.aliases), {"n": "m"})
        self.assertIsInstance(status.aliases, MappingProxyType)
