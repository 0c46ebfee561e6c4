"""Host drain and the dashboard's server side (docs/design.md §Operations): the drain actions
and their token, a drained host skipped while its in-flight requests finish, drains
across a reload, a removed host shown as leaving, the page's headers and files, the
data's token and secrets, the event stream, the recent-requests ring, and with workers
the same drain and the same recent list whichever worker answers.

In-process crossbar on real loopback sockets; the workers' cases run real twistd."""

from __future__ import annotations

import json
import os
import signal
from html.parser import HTMLParser
from typing import Any

import treq
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred
from twisted.internet.task import Clock, deferLater
from twisted.trial.unittest import SynchronousTestCase, TestCase

from crossbar.hosts.balance import Chosen, Rotation, Verdict, choose
from crossbar.ops.dashboard import STATIC, load_static
from crossbar.ops.recent import RecentRequests, entry, token_figures
from crossbar.state.token_window import BUCKET
from crossbar.ops.record import RequestRecord
from tests.test_balance import NAMES, cases
from tests.harness import FakeLlama, http_client, listen, start_crossbar, wait_for
from tests.test_workers import start_workers, worker_pids

TOKEN = "drain-token-9a7e"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _config(hosts: dict[str, str], routes: dict[str, list[str]], token: bool = True, primary: str = "") -> str:
    text = "health: {interval: 60, timeout: 5}\n" + (f"ops: {{token: {TOKEN}}}\n" if token else "")
    text += "hosts:\n" + "".join(f"  {n}: {u}\n" for n, u in hosts.items()) + "routes:\n"
    for name, members in routes.items():
        text += f"  {name}:\n    hosts: [{', '.join(members)}]\n"
        if primary:
            text += f"    primary: {primary}\n"
    return text


async def _chat(http: Any, base: str, route: str = "r", **extra: Any) -> Any:
    return await http.post(base + f"/{route}/v1/chat/completions?q=secret-query",
                           json={"model": "tiny-a", "messages": [{"role": "user", "content": "body-text"}], **extra})


class DrainTests(TestCase):
    timeout = 60

    def test_actions_need_the_token(self) -> object:
        async def go() -> None:
            upstream = FakeLlama()
            url = await listen(self, upstream)
            http = http_client(self)
            _, open_base = await start_crossbar(self, _config({"a": url}, {"r": ["a"]}, token=False))
            # No ops.token: refused whoever asks (anyone who reaches the port could).
            for verb in ("drain", "undrain"):
                response = await http.post(open_base + f"/_crossbar/hosts/a/{verb}", headers=AUTH)
                self.assertEqual(response.code, 403)
                self.assertEqual(response.headers.getRawHeaders(b"content-type"), [b"application/json"])
                self.assertIn("ops.token", (await treq.json_content(response))["error"]["message"])
            service, base = await start_crossbar(self, _config({"a": url}, {"r": ["a"]}))
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
                response = await http.post(base + "/_crossbar/hosts/a/drain", headers=headers)
                self.assertEqual(response.code, 401)
                await treq.content(response)
            self.assertEqual(service.runtime.drained, set())
            # Any configured name, as the page sends it (percent-encoded UTF-8).
            odd_url = await listen(self, FakeLlama())
            odd_service, odd_base = await start_crossbar(self, _config({"gpü:1@x": odd_url}, {"r": ["gpü:1@x"]}))
            response = await http.post(odd_base + "/_crossbar/hosts/gp%C3%BC%3A1%40x/drain", headers=AUTH)
            self.assertEqual(await treq.json_content(response), {"host": "gpü:1@x", "draining": True, "inflight": 0})
            self.assertEqual(odd_service.runtime.drained, {"gpü:1@x"})
            response = await http.post(base + "/_crossbar/hosts/nowhere/drain", headers=AUTH)
            self.assertEqual((response.code, await treq.json_content(response)), (404, {"error": {"code": 404, "message": "no such host", "type": "invalid_request_error"}}))
            response = await http.get(base + "/_crossbar/hosts/a/drain", headers=AUTH)
            self.assertEqual(response.code, 405)
            await treq.content(response)
            response = await http.post(base + "/_crossbar/hosts/a/drain", headers=AUTH)
            self.assertEqual(await treq.json_content(response), {"host": "a", "draining": True, "inflight": 0})
            self.assertEqual(service.runtime.drained, {"a"})
            response = await http.post(base + "/_crossbar/hosts/a/undrain", headers=AUTH)
            self.assertEqual(await treq.json_content(response), {"host": "a", "draining": False, "inflight": 0})
            self.assertEqual(service.runtime.drained, set())

        return ensureDeferred(go())

    def test_drained_host_takes_no_new_request_and_its_stream_finishes(self) -> object:
        async def go() -> None:
            a, b = FakeLlama(), FakeLlama()
            hosts = {"a": await listen(self, a), "b": await listen(self, b)}
            service, base = await start_crossbar(self, _config(hosts, {"r": ["a", "b"]}, primary="a"))
            await service.poller.when_first_round_done()
            http = http_client(self)
            # A stream in flight on a (the primary).
            stream = ensureDeferred(_chat(http, base, stream=True, n=6, delay=0.1))
            await wait_for(lambda: service.runtime.inflight.host("a") == 1, 5, "the stream on a")
            response = await http.post(base + "/_crossbar/hosts/a/drain", headers=AUTH)
            self.assertEqual(await treq.json_content(response), {"host": "a", "draining": True, "inflight": 1})
            status = await treq.json_content(await http.get(base + "/_crossbar/status", headers=AUTH))
            self.assertEqual((status["hosts"]["a"]["draining"], status["hosts"]["a"]["inflight"]), (True, 1))
            self.assertFalse(status["hosts"]["b"]["draining"])
            metrics = (await treq.content(await http.get(base + "/_crossbar/metrics", headers=AUTH))).decode()
            self.assertIn('crossbar_host_draining{host="a"} 1.0', metrics)
            self.assertIn('crossbar_host_draining{host="b"} 0.0', metrics)
            # New requests go to b, though a is the primary.
            before = len(a.seen)
            for _ in range(3):
                response = await _chat(http, base)
                self.assertEqual(response.code, 200)
                await treq.content(response)
            self.assertEqual([s.uri for s in a.seen[before:]], [])
            # The stream on a finishes whole.
            response = await stream
            body = await treq.content(response)
            self.assertEqual(body.count(b"data: {"), 6)
            self.assertTrue(body.endswith(b"data: [DONE]\n\n"))
            status = await treq.json_content(await http.get(base + "/_crossbar/status", headers=AUTH))
            self.assertEqual((status["hosts"]["a"]["draining"], status["hosts"]["a"]["inflight"]), (True, 0))
            # Undrained: the primary takes requests again.
            await treq.content(await http.post(base + "/_crossbar/hosts/a/undrain", headers=AUTH))
            before = len(a.seen)
            await treq.content(await _chat(http, base))
            self.assertEqual(len(a.seen), before + 1)

        return ensureDeferred(go())

    def test_a_request_waits_while_its_only_host_drains(self) -> object:
        async def go() -> None:
            a = FakeLlama()
            service, base = await start_crossbar(self, _config({"a": await listen(self, a)}, {"r": ["a"]}))
            await service.poller.when_first_round_done()
            http = http_client(self)
            await treq.content(await http.post(base + "/_crossbar/hosts/a/drain", headers=AUTH))
            answered: list[int] = []
            waiting = ensureDeferred(_chat(http, base))
            waiting.addCallback(lambda r: answered.append(r.code) or r)
            await wait_for(lambda: service.runtime.queued("r") == 1, 5, "the request queued")
            await deferLater(reactor, 0.3)
            self.assertEqual(answered, [])
            await treq.content(await http.post(base + "/_crossbar/hosts/a/undrain", headers=AUTH))
            response = await waiting
            self.assertEqual(response.code, 200)
            await treq.content(response)

        return ensureDeferred(go())

    def test_drain_survives_a_reload_and_a_removed_host_is_leaving(self) -> object:
        async def go() -> None:
            a, b = FakeLlama(), FakeLlama()
            hosts = {"a": await listen(self, a), "b": await listen(self, b)}
            text = _config(hosts, {"r": ["a", "b"]})
            service, base = await start_crossbar(self, text)
            await service.poller.when_first_round_done()
            http = http_client(self)
            await treq.content(await http.post(base + "/_crossbar/hosts/a/drain", headers=AUTH))
            stream = ensureDeferred(_chat(http, base, stream=True, n=5, delay=0.1))  # on b: a drains
            await wait_for(lambda: service.runtime.inflight.host("b") == 1, 5, "the stream on b")
            # A reload that keeps a and removes b.
            path = self.mktemp()
            with open(path, "w") as f:
                f.write('listen: "tcp:0:interface=127.0.0.1"\n' + _config({"a": hosts["a"]}, {"r": ["a"]}))
            self.assertTrue(service.reload(open(path).read()))
            self.assertEqual(service.runtime.drained, {"a"})
            status = await treq.json_content(await http.get(base + "/_crossbar/status", headers=AUTH))
            self.assertTrue(status["hosts"]["a"]["draining"])
            self.assertEqual((status["hosts"]["b"]["leaving"], status["hosts"]["b"]["inflight"]), (True, 1))
            data = await treq.json_content(await http.get(base + "/_crossbar/dashboard.json", headers=AUTH))
            self.assertEqual([(h["name"], h["leaving"], h["inflight"]) for h in data["hosts"]],
                             [("a", False, 0), ("b", True, 1)])
            await treq.content(await stream)
            status = await treq.json_content(await http.get(base + "/_crossbar/status", headers=AUTH))
            self.assertEqual(list(status["hosts"]), ["a"])
            # A host no longer configured cannot be drained.
            response = await http.post(base + "/_crossbar/hosts/b/drain", headers=AUTH)
            self.assertEqual(response.code, 404)
            await treq.content(response)

        return ensureDeferred(go())


class _Scripts(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.problems: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        names = {k for k, _ in attrs}
        if tag == "script" and "src" not in names:
            self.problems.append("inline <script>")
        self._in_script = tag == "script"
        self.problems += [f"{tag} {k}" for k in names if k.startswith("on") or k == "style"]

    def handle_endtag(self, tag: str) -> None:
        self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.problems.append("script text")


class PageTests(TestCase):
    timeout = 30

    def test_page_files_headers_and_no_inline_script(self) -> object:
        async def go() -> None:
            url = await listen(self, FakeLlama())
            _, base = await start_crossbar(self, _config({"a": url}, {"r": ["a"]}))
            http = http_client(self)
            for path, (name, kind) in STATIC.items():
                response = await http.get(base + "/_crossbar/" + path)  # no token: the page holds no data
                body = await treq.content(response)
                self.assertEqual(response.code, 200, path)
                self.assertEqual(response.headers.getRawHeaders(b"content-type"), [kind.encode()])
                csp = response.headers.getRawHeaders(b"content-security-policy")[0].decode()
                self.assertIn("script-src 'self'", csp)
                self.assertIn("default-src 'none'", csp)
                self.assertNotIn("unsafe", csp)
                self.assertEqual(response.headers.getRawHeaders(b"x-content-type-options"), [b"nosniff"])
                if path:  # the page itself says whether it needs the token
                    self.assertEqual(body, load_static()[path][0])
                else:
                    self.assertIn(b'<body data-login="required">', body)
            # Without the slash: sent to the page's address (its links are relative).
            response = await http.get(base + "/_crossbar", allow_redirects=False)
            self.assertEqual((response.code, response.headers.getRawHeaders(b"location")), (308, [b"/_crossbar/"]))
            await treq.content(response)
            html = (await treq.content(await http.get(base + "/_crossbar/"))).decode()
            scripts = _Scripts()
            scripts.feed(html)
            self.assertEqual(scripts.problems, [])
            script = load_static()["app.js"][0].decode()
            for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new EventSource"):
                self.assertNotIn(sink, script)
            self.assertNotIn("http://", html.replace("http://www.w3.org", ""))

        return ensureDeferred(go())

    def test_files_ship_in_the_package(self) -> None:
        from importlib import resources

        folder = resources.files("crossbar.ops").joinpath("dashboard")
        self.assertEqual({n for n, _ in STATIC.values()} - {p.name for p in folder.iterdir()}, set())
        with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml")) as f:
            pyproject = f.read()
        for name, _ in STATIC.values():
            self.assertIn(f'"dashboard/{name}"', pyproject)

    def test_data_needs_the_token_and_holds_no_secret(self) -> object:
        async def go() -> None:
            a = FakeLlama(models=["tiny-a"])
            url = await listen(self, a)
            service, base = await start_crossbar(self, _config({"a": url}, {"r": ["a"]}))
            await service.poller.when_first_round_done()
            http = http_client(self)
            for path in ("dashboard.json", "events"):
                response = await http.get(base + "/_crossbar/" + path)
                self.assertEqual(response.code, 401)
                self.assertEqual(response.headers.getRawHeaders(b"www-authenticate"), [b'Bearer realm="crossbar"'])
                await treq.content(response)
            response = await _chat(http, base)
            self.assertEqual(response.code, 200)
            await treq.content(response)
            raw = await treq.content(await http.get(base + "/_crossbar/dashboard.json", headers=AUTH))
            for secret in (b"secret-query", b"body-text", TOKEN.encode(), url.encode()):
                self.assertNotIn(secret, raw)
            data = json.loads(raw)
            self.assertEqual([h["name"] for h in data["hosts"]], ["a"])
            self.assertEqual(data["hosts"][0]["loaded"], ["tiny-a"])
            self.assertTrue(data["actions"])
            self.assertEqual([r["name"] for r in data["routes"]], ["r"])
            [recent] = data["recent"]
            self.assertEqual((recent["route"], recent["host"], recent["status"], recent["path"]),
                             ("r", "a", 200, "/v1/chat/completions"))
            self.assertIsNone(recent["tokens"])  # FakeLlama's answers carry no figures
            self.assertEqual(sorted(data["chart"]["hosts"]), ["a"])
            self.assertEqual(len(data["chart"]["hosts"]["a"]), 15 * 60 // BUCKET)

        return ensureDeferred(go())

    def test_recent_requests_show_the_model_as_the_client_named_it(self) -> object:
        async def go() -> None:
            a = FakeLlama(models=["tiny-a"])
            url = await listen(self, a)
            config = _config({"a": url}, {"r": ["a"]}) + "    aliases: {fast: tiny-a}\n"
            service, base = await start_crossbar(self, config)
            await service.poller.when_first_round_done()
            http = http_client(self)
            asked = {
                "unknown": ("/r/v1/chat/completions", "gpt-4o"),
                "alias": ("/r/v1/chat/completions", "fast"),
                "forbidden": ("/r/slots", "gpt-4o"),
                "no route": ("/nowhere/v1/chat/completions", "gpt-4o"),
                "long": ("/r/v1/chat/completions", "<b>" + "m" * 300),
            }
            for path, model in asked.values():
                response = await http.post(base + path, json={"model": model, "messages": []})
                await treq.content(response)
            response = await http.get(base + "/r/props?model=fast&secret=zz")
            await treq.content(response)
            data = await treq.json_content(await http.get(base + "/_crossbar/dashboard.json", headers=AUTH))
            rows = [(e["path"], e["status"], e["model"], e["resolved"]) for e in reversed(data["recent"])]
            self.assertNotIn("secret", json.dumps(data["recent"]))
            self.assertEqual(rows, [
                ("/v1/chat/completions", 200, "gpt-4o", ""),
                ("/v1/chat/completions", 200, "fast", "tiny-a"),
                ("/slots", 403, "gpt-4o", ""),
                ("/v1/chat/completions", 404, "gpt-4o", ""),
                ("/v1/chat/completions", 200, "<b>" + "m" * 197, ""),
                ("/props", 404, "fast", "tiny-a"),  # FakeLlama has no /props
            ])
            # The metrics' label values still come from the config only.
            metrics = (await treq.content(await http.get(base + "/_crossbar/metrics", headers=AUTH))).decode()
            self.assertNotIn("gpt-4o", metrics)
            self.assertNotIn('"fast"', metrics)

        return ensureDeferred(go())

    def test_events_come_every_second_and_end_with_a_drain(self) -> object:
        async def go() -> None:
            url = await listen(self, FakeLlama())
            service, base = await start_crossbar(self, _config({"a": url}, {"r": ["a"]}, token=False))
            http = http_client(self)
            response = await http.get(base + "/_crossbar/events")
            self.assertEqual(response.headers.getRawHeaders(b"content-type"), [b"text/event-stream"])
            events: list[tuple[float, Any]] = []
            buffer = [b""]

            def got(data: bytes) -> None:
                buffer[0] += data
                while b"\n\n" in buffer[0]:
                    block, buffer[0] = buffer[0].split(b"\n\n", 1)
                    self.assertTrue(block.startswith(b"data: "))
                    events.append((reactor.seconds(), json.loads(block[6:])))

            done = treq.collect(response, got)
            await wait_for(lambda: len(events) >= 3, 4, "three events")
            gaps = [b[0] - a[0] for a, b in zip(events, events[1:])]
            self.assertTrue(all(0.5 < g < 2.0 for g in gaps), gaps)
            self.assertEqual(events[0][1]["hosts"][0]["name"], "a")
            self.assertFalse(events[0][1]["actions"])
            service.runtime.draining = True  # crossbar drains: the stream ends, the page reconnects
            await done

        return ensureDeferred(go())

    def test_events_end_when_a_reload_changes_the_token(self) -> object:
        async def go() -> None:
            url = await listen(self, FakeLlama())
            service, base = await start_crossbar(self, _config({"a": url}, {"r": ["a"]}))
            http = http_client(self)
            response = await http.get(base + "/_crossbar/events", headers=AUTH)
            self.assertEqual(response.code, 200)
            got: list[bytes] = []
            done = treq.collect(response, got.append)
            await wait_for(lambda: got, 3, "the first event")
            new = 'listen: "tcp:0:interface=127.0.0.1"\n' + _config({"a": url}, {"r": ["a"]}).replace(TOKEN, "new-token")
            self.assertTrue(service.reload(new))
            await done.addTimeout(3, reactor)  # ended within one event

        return ensureDeferred(go())


def _record(host: str = "a", route: str = "r", tokens: dict[str, int] | None = None) -> RequestRecord:
    """A record; with ``tokens`` (``prompt``, ``cached``, ``generated``), the figures of a
    complete answer that said so."""
    from crossbar.ops.figures import Figures

    figures = None if tokens is None else Figures(tokens.get("prompt", 0), tokens.get("cached", 0),
                                                  tokens.get("generated", 0), None, None)
    return RequestRecord(route=route, host=host, method="POST", path="/v1/chat/completions",
                         target=f"/{route}/v1/chat/completions", status=200, bytes=10, duration=0.5, ttfb=0.1,
                         why="loaded least-busy", figures=figures)


class RecentTests(SynchronousTestCase):
    def test_token_figures_read_what_the_record_has(self) -> None:
        from crossbar.ops.figures import Figures

        self.assertIsNone(token_figures(_record()))
        figures = token_figures(_record()._replace(figures=Figures(10, 30, 5, 800.0, 42.5)))
        self.assertEqual(figures, {"prompt": 10.0, "cached": 30.0, "generated": 5.0, "tps": 42.5})
        e = entry(100.0, _record()._replace(named="m<1>", model="other", ended="cut", figures=Figures(0, 0, 3, None, None)))
        self.assertEqual((e["model"], e["ended"], e["tokens"]), ("m<1>", "cut", {"prompt": 0.0, "cached": 0.0,
                                                                              "generated": 3.0, "tps": None}))
        self.assertEqual(entry(1.0, _record())["model"], "")

    def test_entry_shows_the_model_as_named_and_what_an_alias_made_of_it(self) -> None:
        # The metrics' label is "other" for a model no host lists; the page shows what
        # the client sent, cut to 200 characters, and the alias's target beside it.
        e = entry(1.0, _record()._replace(model="other", named="gpt-4o", resolved="gpt-4o"))
        self.assertEqual((e["model"], e["resolved"]), ("gpt-4o", ""))
        e = entry(1.0, _record()._replace(model="tiny-a", named="fast", resolved="tiny-a"))
        self.assertEqual((e["model"], e["resolved"]), ("fast", "tiny-a"))
        e = entry(1.0, _record()._replace(model="other", named="x" * 500 + "<b>", resolved="y" * 300))
        self.assertEqual((e["model"], e["resolved"]), ("x" * 200, "y" * 200))
        e = entry(1.0, _record()._replace(model="tiny-a", resolved="tiny-a"))  # a default_model
        self.assertEqual((e["model"], e["resolved"]), ("", "tiny-a"))

    def test_one_append_per_request_entries_only_for_a_look(self) -> None:
        clock = Clock()
        clock.advance(10_000)
        recent = RecentRequests(clock.seconds)
        recent.observe(_record(tokens={"generated": 50, "prompt": 10, "cached": 30}))
        recent.tick()
        self.assertEqual(list(recent.entries), [])  # entries only for someone who looks
        entries = recent.view()
        self.assertEqual([e["tokens"]["generated"] for e in entries], [50.0])
        for i in range(400):
            recent.observe(_record(host=f"h{i}"))
        recent.tick()
        entries = recent.view()
        self.assertEqual(len(entries), 300)  # bounded: the newest first
        self.assertEqual((entries[0]["host"], entries[-1]["host"]), ("h399", "h100"))

    def test_workers_see_every_workers_requests(self) -> None:
        clock = Clock()
        clock.advance(time_now())
        directory = self.mktemp()
        os.makedirs(directory)
        first, second = RecentRequests(clock.seconds, directory, 0), RecentRequests(clock.seconds, directory, 1)
        first.observe(_record(host="a", tokens={"generated": 7}))
        second.observe(_record(host="b"))
        first.tick()
        second.tick()
        # Nobody looked yet: no file written.
        self.assertEqual(sorted(os.listdir(directory)), [])
        entries = first.view()  # a look: its own file now, the other's on its tick
        self.assertEqual([e["host"] for e in entries], ["a"])
        clock.advance(1.0)  # a worker looks at the watch file once a second
        second.tick()
        entries = first.view()
        self.assertEqual(sorted(e["host"] for e in entries), ["a", "b"])
        # A restarted worker takes its entries back from its file.
        again = RecentRequests(clock.seconds, directory, 1)
        self.assertEqual([e["host"] for e in again.entries], ["b"])


def time_now() -> float:
    import time

    return time.time()


class WorkerTests(TestCase):
    timeout = 120

    def test_drain_and_recent_requests_in_every_worker(self) -> object:
        async def go() -> None:
            a, b = FakeLlama(), FakeLlama()
            hosts = {"a": await listen(self, a), "b": await listen(self, b)}
            config = _config(hosts, {"r": ["a", "b"]}, primary="a").replace("interval: 60", "interval: 0.5")
            proc = await start_workers(self, config)
            from twisted.web.client import Agent, HTTPConnectionPool
            from treq.client import HTTPClient

            pool = HTTPConnectionPool(reactor, persistent=False)  # a new connection (and worker) each time
            self.addCleanup(pool.closeCachedConnections)
            http = HTTPClient(Agent(reactor, pool=pool))
            response = await http.post(proc.base + "/_crossbar/hosts/a/drain", headers=AUTH)
            self.assertEqual(response.code, 200)
            await treq.content(response)
            # The supervisor tells the other worker, which reads it when its reactor runs:
            # wait (bounded) until looks on new connections, whichever worker, all say so.
            await proc.line(lambda line: "host a drained in every worker" in line, 10, "the supervisor's drain")

            async def looks(n: int) -> list[Any]:
                return [await treq.json_content(await http.get(proc.base + "/_crossbar/dashboard.json", headers=AUTH))
                        for _ in range(n)]

            async def all_draining() -> bool:
                return all([h["draining"] for h in data["hosts"]] == [True, False] for data in await looks(8))

            await wait_for(all_draining, 10, "every worker lists a as draining", step=0.25)
            before = len(a.seen)
            for _ in range(12):
                response = await _chat(http, proc.base)
                self.assertEqual(response.code, 200)
                await treq.content(response)
            self.assertEqual([s.uri for s in a.seen[before:] if s.uri.startswith(b"/v1/chat")], [])
            # Every worker says a is draining; every worker lists all 12 requests.
            for _ in range(4):  # the first looks tell every worker that someone watches
                await treq.json_content(await http.get(proc.base + "/_crossbar/dashboard.json", headers=AUTH))
            # The other worker's file is written on its tick (once a second): wait (bounded)
            # until looks on new connections, whichever worker, all list the 12.
            async def all_list_12() -> bool:
                return all(len([e for e in data["recent"] if e["route"] == "r"]) == 12 for data in await looks(8))

            await wait_for(all_list_12, 10, "every worker lists the 12 requests", step=0.25)
            for _ in range(8):
                data = await treq.json_content(await http.get(proc.base + "/_crossbar/dashboard.json", headers=AUTH))
                self.assertEqual([h["draining"] for h in data["hosts"]], [True, False])
                self.assertEqual(len([e for e in data["recent"] if e["route"] == "r"]), 12)
            # A worker that dies is restarted drained: the supervisor tells it.
            ready = lambda: len([line for line in proc.out if '"message": "worker 0 is ready"' in line])  # noqa: E731
            readies = ready()
            os.kill(worker_pids(proc)[0], signal.SIGKILL)
            await wait_for(lambda: ready() > readies, 30, "worker 0 restarted")
            before = len(a.seen)
            for _ in range(12):
                response = await _chat(http, proc.base)
                self.assertEqual(response.code, 200)
                await treq.content(response)
            self.assertEqual([s.uri for s in a.seen[before:] if s.uri.startswith(b"/v1/chat")], [])
            # A reload keeps the drain in every worker.
            with open(proc.config_path, "a") as f:
                f.write("  s:\n    hosts: [a, b]\n")
            proc.signal("HUP")
            await proc.line(lambda line: "reloaded" in line and '"worker": 0' in line)
            await proc.line(lambda line: "reloaded" in line and '"worker": 1' in line)
            before = len(a.seen)
            for _ in range(8):
                response = await _chat(http, proc.base, route="s")
                self.assertEqual(response.code, 200)
                await treq.content(response)
            self.assertEqual([s.uri for s in a.seen[before:] if s.uri.startswith(b"/v1/chat")], [])
            # Undrained through whichever worker: every worker sends to a again.
            await treq.content(await http.post(proc.base + "/_crossbar/hosts/a/undrain", headers=AUTH))
            await proc.line(lambda line: "host a undrained in every worker" in line, 10, "the supervisor's undrain")

            async def none_draining() -> bool:
                return all([h["draining"] for h in data["hosts"]] == [False, False] for data in await looks(8))

            await wait_for(none_draining, 10, "no worker lists a as draining", step=0.25)
            before = len(a.seen)
            for _ in range(6):
                await treq.content(await _chat(http, proc.base))
            self.assertEqual(len([s for s in a.seen[before:] if s.uri.startswith(b"/v1/chat")]), 6)

        return ensureDeferred(go())


class DrainChoiceProperties(SynchronousTestCase):
    """A draining host is skipped as if it had no room and pins no tier (docs/design.md
    §Operations): choosing with it draining is choosing without it, except that a
    request whose only healthy hosts drain waits (BUSY) rather than fail."""

    @settings(max_examples=300, deadline=None)
    @given(cases(), st.sets(st.sampled_from(NAMES)))
    def test_draining_is_skipped_and_waited_for(self, case: Any, draining: set[str]) -> None:
        got = choose(case.route, case.hosts, case.statuses, case.inflight, case.model, None, Rotation(),
                     case.exclude, draining=draining)
        if isinstance(got, Chosen):
            self.assertNotIn(got.host, draining)
        without = choose(case.route, case.hosts, case.statuses, case.inflight, case.model, None, Rotation(),
                         tuple(case.exclude) + tuple(draining))
        if [h for h in case.candidates() if h not in draining]:
            self.assertEqual(got, without)
        else:  # only draining hosts are healthy (wait for them), or none is (as before)
            self.assertIs(got, Verdict.BUSY if case.candidates() or case.unpolled() else Verdict.NO_HOST)
