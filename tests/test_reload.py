"""SIGHUP reload (docs/design.md §Operations): the plan, the table and poller changes, and a
real ``twistd`` process reloaded with a stream in flight."""

from __future__ import annotations

import os
import signal

import treq
import trustme
from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred
from twisted.internet.task import Clock
from twisted.logger import formatEvent
from twisted.trial.unittest import TestCase

from crossbar.config import parse_config
from crossbar.hosts.health import HealthTable
from crossbar.hosts.poller import HealthPoller
from crossbar.process.reload import ReloadPlan, SIGHUPReload, plan_reload
from tests.fakes import FakeProbe
from tests.harness import FakeLlama, http_client, listen, wait_for
from tests.process import ClientStream, start_twistd


def _cfg(hosts: str, listen: str = "tcp:7777") -> str:
    return f"listen: \"{listen}\"\nhosts:\n{hosts}\nroutes:\n  r:\n    hosts: [a]\n"


class PlanTests(TestCase):
    def test_fresh_removed(self) -> None:
        old = parse_config(_cfg("  a: http://h:1\n  b: http://h:2\n  c: http://h:3"))
        new = parse_config(_cfg("  a: http://h:1\n  b: http://h:9\n  d: http://h:4", listen="tcp:8888"))
        plan = plan_reload(old, new)
        self.assertEqual(plan.fresh, ("b", "d"))  # a, unchanged, is in neither: it keeps its health
        self.assertEqual(plan.removed, ("c",))
        self.assertTrue(plan.listen_changed)
        self.assertFalse(plan_reload(old, old).listen_changed)
        self.assertEqual(plan_reload(old, old), ReloadPlan(fresh=(), removed=(), listen_changed=False))

    def test_changed_connection_settings_start_over(self) -> None:
        """docs/design.md §Operations: a host whose URL, ``tls`` or ``api_key`` changed starts over."""
        ca_dir = self.mktemp()
        os.makedirs(ca_dir)
        ca = trustme.CA()
        ca_path = os.path.join(ca_dir, "ca.pem")
        ca.cert_pem.write_to_path(ca_path)
        env = {"K1": "key-one", "K2": "key-two"}
        old = parse_config(_cfg(
            "  a: {url: https://h:1, api_key: ${K1}}\n  b: {url: https://h:2}\n  c: {url: https://h:3, tls: {verify: true}}"
            "\n  d: {url: http://h:4, weight: 1}"
        ), environ=env)
        new = parse_config(_cfg(
            "  a: {url: https://h:1, api_key: ${K2}}\n  b: {url: https://h:2, tls: {ca: " + ca_path + "}}"
            "\n  c: {url: https://h:3, tls: {verify: false}}\n  d: {url: http://h:4, weight: 3, max_inflight: 2}"
        ), environ=env)
        self.assertEqual(plan_reload(old, new).fresh, ("a", "b", "c"))  # d: only its balancing changed
        self.assertEqual(plan_reload(old, new).changed, ("a", "b", "c", "d"))

    def test_summary_counts_a_weight_change(self) -> None:
        """Issue 20 item 11: after a weight change the reload said ``0 new or changed``."""
        old = parse_config(_cfg("  a: http://h:1\n  b: http://h:2\n  c: http://h:3"))
        new = parse_config(_cfg("  a: {url: http://h:1, weight: 2}\n  b: http://h:9\n  d: http://h:4"))
        plan = plan_reload(old, new)
        self.assertEqual((plan.fresh, plan.changed, plan.removed), (("b", "d"), ("a", "b"), ("c",)))
        self.assertEqual(plan.summary(), "1 new, 2 changed (1 start over), 1 removed")
        self.assertEqual(plan_reload(old, old).summary(), "0 new, 0 changed (0 start over), 0 removed")

    def test_rotated_ca_file_starts_over(self) -> None:
        """The CA's bytes are part of ``tls``: a reload after the file was replaced reconnects."""
        ca_dir = self.mktemp()
        os.makedirs(ca_dir)
        ca_path = os.path.join(ca_dir, "ca.pem")
        text = _cfg("  a: {url: https://h:1, tls: {ca: " + ca_path + "}}")
        trustme.CA().cert_pem.write_to_path(ca_path)
        old = parse_config(text)
        self.assertEqual(plan_reload(old, parse_config(text)).fresh, ())
        trustme.CA().cert_pem.write_to_path(ca_path)
        self.assertEqual(plan_reload(old, parse_config(text)).fresh, ("a",))


class TableAndPollerTests(TestCase):
    def test_table_keeps_unchanged_hosts(self) -> None:
        table = HealthTable(["a", "b", "c"], 2, 1, lambda: 100.0)
        for name in ("a", "b", "c"):
            table.record_success(name, ["m"])
        table.set_hosts(["b", "a", "d"], reset=["b"])
        self.assertEqual(tuple(table.all()), ("b", "a", "d"))
        a = table.get("a")
        assert a is not None
        self.assertTrue(a.healthy)
        self.assertEqual(a.loaded, ("m",))
        b = table.get("b")
        assert b is not None
        self.assertFalse(b.healthy)
        self.assertFalse(b.polled)
        self.assertIsNone(table.get("c"))

    def test_each_part_takes_what_it_keeps_from_the_new_config(self) -> None:
        """Issue 30 item 5: a reload hands the new config to each part, which takes the
        fields it keeps: the table its thresholds and hosts, the poller its probe, timing
        and hosts, the pools their TLS policy and connect timeout."""
        from crossbar.upstream.pools import UpstreamPools

        new = parse_config(
            "listen: tcp:1\nhealth: {interval: 7, timeout: 3, recovery_polls: 4, failure_threshold: 2}\n"
            "timeouts: {connect: 9}\nhosts: {a: http://h:1, d: http://h:4}\nroutes: {r: {hosts: [a, d]}}\n",
            "x.yaml", environ={})
        table = HealthTable(["a", "b"], 2, 1, lambda: 100.0)
        table.reconfigure(new, fresh=["a"])
        self.assertEqual((table.recovery_polls, table.failure_threshold, tuple(table.all())), (4, 2, ("a", "d")))
        clock = Clock()
        poller = HealthPoller(table, {"a": "http://h:1"}, FakeProbe(), 60, 5, clock)
        probe = FakeProbe()
        poller.reconfigure(new, probe)
        self.assertEqual((poller.probe, poller.interval, poller.timeout), (probe, 7, 3))
        self.assertEqual({name: str(url.url) for name, url in poller.hosts.items()}, {"a": "http://h:1", "d": "http://h:4"})
        pools = UpstreamPools(clock, connect_timeout=5.0)
        tls = object()
        pools.reconfigure(new, tls)  # type: ignore[arg-type]
        self.assertEqual((pools.tls, pools.connect_timeout), (tls, 9))

    def test_poller_polls_new_hosts_at_once_and_cancels_stale_polls(self) -> None:
        clock = Clock()
        probe = FakeProbe()
        table = HealthTable(["a", "b"], 2, 1, clock.seconds)
        poller = HealthPoller(table, {"a": "http://a", "b": "http://b"}, probe, 30, 5, clock)
        poller.startService()
        self.addCleanup(poller.stopService)
        probe.succeed("http://a", ("m",))
        self.assertEqual(len(probe.pending("http://b")), 1)
        table.set_hosts(["a", "b", "c"], reset=["b"])
        poller.set_hosts({"a": "http://a", "b": "http://b2", "c": "http://c"})
        # b's poll of its old URL is cancelled and records nothing; b and c are polled now.
        self.assertEqual(probe.pending("http://b"), [])
        self.assertEqual(len(probe.pending("http://b2")), 1)
        self.assertEqual(len(probe.pending("http://c")), 1)
        self.assertEqual(probe.pending("http://a"), [], "a is not polled early")
        b = table.get("b")
        assert b is not None
        self.assertFalse(b.polled)
        probe.succeed("http://c", ("n",))
        c = table.get("c")
        assert c is not None
        self.assertTrue(c.healthy)
        poller.set_timing(1, 5)
        clock.advance(30)  # the round already scheduled, then every second
        self.assertEqual(len(probe.pending("http://a")), 1)
        probe.succeed("http://a", ("m",))
        clock.advance(1)
        self.assertEqual(len(probe.pending("http://a")), 1)


    def test_poller_polls_hosts_reset_for_new_settings_at_once(self) -> None:
        """Same URL, new ``api_key`` or ``tls``: reset by the reload, so polled now
        (readiness and waiting requests wait for that poll, not for the next round)."""
        clock = Clock()
        probe = FakeProbe()
        table = HealthTable(["a"], 2, 1, clock.seconds)
        poller = HealthPoller(table, {"a": "http://a"}, probe, 60, 5, clock)
        poller.startService()
        self.addCleanup(poller.stopService)
        probe.succeed("http://a", ("m",))
        table.set_hosts(["a"], reset=["a"])
        poller.set_hosts({"a": "http://a"}, fresh=["a"])
        self.assertEqual(len(probe.pending("http://a")), 1)
        probe.succeed("http://a", ("m",))
        status = table.get("a")
        assert status is not None
        self.assertTrue(status.polled and status.healthy)


class SignalTests(TestCase):
    def test_handler_installed_and_restored(self) -> None:
        calls: list[int] = []
        before = signal.getsignal(signal.SIGHUP)

        class _Reactor:
            def callFromThread(self, f: object, *a: object) -> None:
                calls.append(1)
                f()  # type: ignore[operator]

        reloads: list[int] = []
        service = SIGHUPReload(lambda: reloads.append(1), _Reactor())
        service.startService()
        self.assertIsNot(signal.getsignal(signal.SIGHUP), before)
        signal.raise_signal(signal.SIGHUP)
        self.assertEqual((calls, reloads), ([1], [1]))
        service.stopService()
        self.assertIs(signal.getsignal(signal.SIGHUP), before)


def _twistd_config(a: str, b: str | None, token: str, listen: str = "tcp:0:interface=127.0.0.1") -> str:
    hosts = f"  a: {a}\n" + (f"  b: {b}\n" if b else "")
    routes = "  r:\n    hosts: [a]\n" + ("  r2:\n    hosts: [b]\n" if b else "")
    return f"""
listen: "{listen}"
health: {{interval: 60, timeout: 2}}
drain: {{delay: 0.2, grace: 2}}
ops: {{token: {token}}}
hosts:
{hosts}routes:
{routes}"""


class TwistdReloadTests(TestCase):
    timeout = 60

    def test_sighup_reload_with_stream_in_flight(self) -> object:
        async def go() -> None:
            up_a, up_b = FakeLlama(), FakeLlama(models=["tiny-b"])
            url_a, url_b = await listen(self, up_a), await listen(self, up_b)
            proc = await start_twistd(self, _twistd_config(url_a, None, "t1"))
            http = http_client(self)

            async def status(token: str) -> tuple[int, dict]:  # type: ignore[type-arg]
                response = await http.get(proc.base + "/_crossbar/status",
                                          headers={"Authorization": f"Bearer {token}"})
                return response.code, await treq.json_content(response)

            code, before = await status("t1")
            self.assertEqual(code, 200)
            stream = ClientStream(http, proc.base + "/r/v1/chat/completions", n=30, delay=0.1)
            await stream.first

            with open(proc.config_path, "w") as f:
                f.write(_twistd_config(url_a, url_b, "t2"))
            proc.signal("HUP")
            await proc.line(lambda line: "reloaded" in line, 10)

            # Token swapped; a kept its health (interval 60: not re-polled); b polled at once.
            self.assertEqual((await status("t1"))[0], 401)
            _, after = await status("t2")
            self.assertEqual(after["hosts"]["a"]["last_ok"], before["hosts"]["a"]["last_ok"])
            self.assertTrue(after["hosts"]["a"]["healthy"])
            self.assertEqual(after["hosts"]["a"]["inflight"], 1)

            async def b_healthy() -> bool:
                return bool((await status("t2"))[1]["hosts"]["b"]["healthy"])

            await wait_for(b_healthy, 10, "b healthy after reload")
            response = await http.post(proc.base + "/r2/v1/chat/completions", json={"messages": []})
            self.assertEqual(response.code, 200)
            self.assertEqual(response.headers.getRawHeaders(b"x-crossbar-host"), [b"b"])
            await treq.content(response)

            # An invalid file is refused, the running config kept.
            with open(proc.config_path, "w") as f:
                f.write(_twistd_config(url_a, url_b, "t3") + "bogus: 1\n")
            proc.signal("HUP")
            await proc.line(lambda line: "reload refused" in line and "bogus" in line, 10)
            self.assertEqual((await status("t2"))[0], 200)
            self.assertEqual((await status("t3"))[0], 401)

            # listen cannot change live: logged, still served on the same port.
            with open(proc.config_path, "w") as f:
                f.write(_twistd_config(url_a, url_b, "t4", listen="tcp:1:interface=127.0.0.1"))
            proc.signal("HUP")
            await proc.line(lambda line: "restart is needed" in line, 10)
            self.assertEqual((await status("t4"))[0], 200)

            # A listen start-up would refuse is refused on reload too (the running
            # config, token t4, is kept).
            with open(proc.config_path, "w") as f:
                f.write(_twistd_config(url_a, url_b, "t5", listen="nonsense"))
            proc.signal("HUP")
            await proc.line(lambda line: "reload refused" in line and "listen" in line, 10)
            self.assertEqual((await status("t4"))[0], 200)

            # The stream that was in flight through all of this ended intact.
            how, body = await stream.done
            self.assertEqual(how, "complete")
            self.assertEqual(ClientStream.events(body), list(range(30)))
            self.assertNotIn("Traceback", proc.text())
            proc.signal("TERM")
            await proc.ended

        return ensureDeferred(go())


class ReloadWithWaitingRequestsTests(TestCase):
    """A reload that resets a host (its URL, ``tls`` or ``api_key`` changed) must not
    answer the route's waiting requests 503 while that host waits for its first poll
    (docs/design.md §Operations: reload drops no waiting request)."""

    async def test_api_key_rotation_keeps_the_queue(self) -> None:
        from tests.harness import start_crossbar
        from tests.logs import LogCapture
        from tests.test_access_keys import Held

        log = LogCapture(self)
        host = FakeLlama(["model-a"])
        host.handlers[b"/v1/chat/completions"] = held = Held()
        url = await listen(self, host)
        text = ("health: {interval: 60, timeout: 5}\n"
                f"hosts:\n  a: {{url: {url}, max_inflight: 1}}\n"
                "routes:\n  r:\n    hosts: [a]\n    queue: {max: 5, timeout: 20}\n    affinity: {key: none}\n")
        service, base = await start_crossbar(self, text)
        await service.poller.when_first_round_done()
        client = http_client(self)
        first = ensureDeferred(client.post(base + "/r/v1/chat/completions", json={"model": "model-a"}))
        await wait_for(lambda: len(held.requests) == 1, what="the first request at the host")
        second = ensureDeferred(client.post(base + "/r/v1/chat/completions", json={"model": "model-a"}))
        await wait_for(lambda: service.runtime.queued("r") == 1, what="the second request waiting")
        running = service.runtime.config.text
        self.assertTrue(service.reload(text=running.replace("max_inflight: 1}", "max_inflight: 1, api_key: k3y}")))
        self.assertEqual(service.runtime.config.hosts["a"].api_key, "k3y")
        await wait_for(lambda: getattr(service.table.get("a"), "polled", False), what="the reset host polled")
        self.assertEqual(service.runtime.queued("r"), 1)  # still waiting, not answered 503
        held.release()
        await wait_for(lambda: len(held.requests) == 1, what="the second request at the host")
        held.release()
        for d in (first, second):
            response = await d
            self.assertEqual(response.code, 200)
            await response.content()
        self.assertEqual([e["status"] for e in log.proxied()], [200, 200])

    def test_a_workers_change_needs_a_restart(self) -> None:
        from crossbar.process.service import make_service
        from tests.logs import LogCapture

        log = LogCapture(self)
        text = "listen: tcp:0:interface=127.0.0.1\nhosts: {a: 'http://127.0.0.1:1'}\nroutes: {r: {hosts: [a]}}\n"
        service = make_service(parse_config(text, "test.yaml"))
        self.assertTrue(service.reload(text="workers: 2\n" + text))
        self.assertEqual(service.runtime.config.workers, 1)
        texts = [formatEvent(e) for e in log.events]
        self.assertTrue(any("workers changed from 1 to 2" in line for line in texts), texts)


class ReloadPollConnectionTests(TestCase):
    async def test_changed_host_is_polled_on_a_new_connection(self) -> None:
        """A kept-alive poll connection opened under the old ``tls`` (or key) must not
        carry the changed host's polls: a CA that no longer holds went on passing."""
        from tests.harness import start_crossbar

        host = FakeLlama(["model-a"])
        url = await listen(self, host)
        text = (f"health: {{interval: 60, timeout: 5}}\nhosts:\n  a: {{url: {url}}}\n"
                "routes:\n  r:\n    hosts: [a]\n")
        service, _ = await start_crossbar(self, text)
        await service.poller.when_first_round_done()
        before = {s.client.port for s in host.seen}  # type: ignore[attr-defined]
        seen = len(host.seen)
        self.assertTrue(service.reload(text=service.runtime.config.text.replace(f"{{url: {url}}}",
                                                                               f"{{url: {url}, api_key: k3y}}")))
        await wait_for(lambda: len(host.seen) >= seen + 2, what="the changed host polled again")
        after = {s.client.port for s in host.seen[seen:]}  # type: ignore[attr-defined]
        self.assertFalse(after & before, (before, after))
