"""The dashboard in a real headless Chromium (docs/design.md §Operations): a real crossbar on
loopback with loopback hosts, the page driven by selenium (tests/browser.py).

What a user sees: the login form (and again after a wrong token), each host and route,
a request appearing in the recent list within 2 s, a host going down turning red
within one poll, the drain button draining, a hostile model id shown as text, no
console error, the page live again after crossbar restarts, a phone-sized layout.
A screenshot of each state is saved (tests/browser.py: ``$CROSSBAR_ARTIFACTS``)."""

from __future__ import annotations

import json
import re
import socket
from typing import Any

import treq
from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase

from crossbar.config import parse_config
from crossbar.process.service import CrossbarService, make_service
from crossbar.ops.recent import token_figures
from tests.browser import Browser, require_chromium, table_rows
from tests.harness import FakeLlama, http_client, listen, require_llama_server, start_crossbar
from tools.llama_server import LlamaServer, model_path

TOKEN = "dash-token-5f1c"
EVIL = "<img src=x onerror=alert(1)>"


def _config(a: str, b: str, evil: str, token: bool = True) -> str:
    return (
        "health: {interval: 0.5, timeout: 1, recovery_polls: 1}\n"
        + (f"ops: {{token: {TOKEN}}}\n" if token else "")
        + f"hosts:\n  gpu-a: {a}\n  gpu-b: {b}\n  odd-host: {evil}\n"
        + "routes:\n  chat:\n    hosts: [gpu-a, gpu-b]\n  odd:\n    hosts: [odd-host]\n"
    )


def _by(css: str) -> Any:
    from selenium.webdriver.common.by import By

    return By.CSS_SELECTOR, css


def _visible(css: str) -> Any:
    def look(d: Any) -> bool:
        return bool(d.find_element(*_by(css)).is_displayed())
    return look


def _host_class(name: str) -> Any:
    def look(d: Any) -> str:
        return str(d.find_element(*_by(f'article.host[data-host="{name}"]')).get_attribute("class"))
    return look


def _recent_rows(d: Any) -> list[list[str]]:
    return [cells for _, cells in table_rows(d, "#recent tbody tr")]


async def _chat(http: Any, base: str, model: str = "tiny-a", headers: dict[str, str] | None = None) -> int:
    response = await http.post(
        base + "/chat/v1/chat/completions?secret-query=zzz",
        data=json.dumps({"model": model, "messages": [{"role": "user", "content": "body-secret"}]}).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    await treq.content(response)
    return int(response.code)


class DashboardBrowserTests(TestCase):
    timeout = 120

    def setUp(self) -> None:
        require_chromium(self)

    async def _fleet(self, token: bool = True) -> tuple[CrossbarService, str, FakeLlama, FakeLlama]:
        a, b = FakeLlama(models=["tiny-a"]), FakeLlama(models=["tiny-b"])
        evil = FakeLlama(models=[EVIL])
        urls = [await listen(self, u) for u in (a, b, evil)]
        service, base = await start_crossbar(self, _config(*urls, token=token))
        await service.poller.when_first_round_done()
        return service, base, a, b

    async def _browser(self, width: int = 1280, height: int = 900, phone: bool = False) -> Browser:
        browser = await Browser.open(width, height, phone)
        self.addCleanup(lambda: ensureDeferred(browser.close()))
        return browser

    def test_login_fleet_recent_drain_down_escaping(self) -> object:
        async def go() -> None:
            service, base, a, b = await self._fleet()
            http = http_client(self)
            browser = await self._browser()
            await browser.get(base + "/_crossbar/")
            # With a token configured and none given: the login form only.
            await browser.wait(_visible("#login"), 5, "the login form")
            self.assertFalse(await browser.call(lambda d: d.find_element(*_by("#board")).is_displayed()))
            self.assertEqual(await browser.console_errors(), [])  # no data asked for before the token
            await browser.screenshot("login")

            # A wrong token: the login form again, saying so.
            async def log_in(token: str) -> None:
                await browser.call(lambda d: d.find_element(*_by("#token")).send_keys(token))
                await browser.call(lambda d: d.find_element(*_by("#login-form button")).click())

            await log_in("not-the-token")
            await browser.wait(lambda d: d.find_element(*_by("#login-error")).text == "Wrong token.", 5,
                               "the wrong-token message")
            self.assertFalse(await browser.call(lambda d: d.find_element(*_by("#board")).is_displayed()))
            await browser.screenshot("wrong-token")

            await log_in(TOKEN)
            await browser.wait(_visible("#board"), 5, "the board")
            # Each host and route.
            for host in ("gpu-a", "gpu-b", "odd-host"):
                await browser.wait(lambda d, h=host: "up" in _host_class(h)(d).split(), 5, f"{host} up")
            routes = await browser.call(lambda d: [tr.get_attribute("data-route")
                                                   for tr in d.find_elements(*_by("#routes tbody tr"))])
            self.assertEqual(sorted(routes), ["chat", "odd"])

            # A hostile model id is shown as text; nothing of it runs or becomes markup.
            odd = await browser.call(lambda d: [dd.text for dd in d.find_elements(
                *_by('article.host[data-host="odd-host"] dd.loaded, article.host[data-host="odd-host"] dd.available'))])
            self.assertIn(EVIL, odd)
            self.assertEqual(await browser.call(lambda d: len(d.find_elements(*_by("#board img")))), 0)
            await browser.screenshot("fleet")

            # A request made now is in the recent list within 2 s, with no query
            # string, body or token on the page.
            self.assertEqual(await _chat(http, base), 200)
            rows = await browser.wait(lambda d: [r for r in _recent_rows(d) if r[1] == "chat"], 10,
                                      "the request in the recent list")
            self.assertEqual(rows[0][5], "200")
            self.assertIn(rows[0][4], ("gpu-a", "gpu-b"))
            page = await browser.call(lambda d: d.page_source)
            for secret in ("secret-query", "zzz", "body-secret", TOKEN):
                self.assertNotIn(secret, page)
            await browser.screenshot("recent")

            # Filter: a host the request did not go to shows none of it.
            other = "gpu-b" if rows[0][4] == "gpu-a" else "gpu-a"

            def choose_host(d: Any, name: str) -> None:
                from selenium.webdriver.support.ui import Select
                Select(d.find_element(*_by("#filter-host"))).select_by_value(name)

            await browser.call(choose_host, other)
            await browser.wait(lambda d: not [r for r in _recent_rows(d) if r[4] == rows[0][4]], 10, "the filter")
            await browser.call(choose_host, "")

            # The drain button drains: the card says so, status agrees, requests go
            # to the other host.
            button = 'article.host[data-host="gpu-a"] button.drain'
            await browser.call(lambda d: d.find_element(*_by(button)).click())
            await browser.wait(lambda d: "draining" in _host_class("gpu-a")(d).split(), 10, "gpu-a draining")
            self.assertEqual(service.runtime.drained, {"gpu-a"})
            seen_a = len(a.seen)
            for _ in range(3):
                self.assertEqual(await _chat(http, base, model="tiny-a"), 200)
            self.assertEqual([s.uri for s in a.seen[seen_a:] if s.uri.startswith(b"/v1/chat")], [])
            await browser.wait(lambda d: d.find_element(*_by(button)).text == "Undrain", 10, "the undrain button")
            await browser.screenshot("drained")
            await browser.call(lambda d: d.find_element(*_by(button)).click())
            await browser.wait(lambda d: "up" in _host_class("gpu-a")(d).split(), 10, "gpu-a undrained")
            self.assertEqual(service.runtime.drained, set())

            # A host going down turns red within one poll (0.5 s) and one event (1 s).
            b.health_code = 503
            await browser.wait(lambda d: "down" in _host_class("gpu-b")(d).split(), 0.5 + 1.0 + 0.5,
                               "gpu-b down")
            error = await browser.call(
                lambda d: d.find_element(*_by('article.host[data-host="gpu-b"] dd.last-error')).text)
            self.assertNotEqual(error, "—")
            await browser.screenshot("host-down")

            # The overview (the README's picture): one host draining, one down, a few requests.
            await treq.content(await http.post(base + "/_crossbar/hosts/gpu-a/drain",
                                               headers={"Authorization": f"Bearer {TOKEN}"}))
            await browser.wait(lambda d: "draining" in _host_class("gpu-a")(d).split(), 10, "gpu-a draining")
            await browser.screenshot("overview")

            # Nothing went wrong in the page but the refused wrong token.
            errors = [e for e in await browser.console_errors() if "401" not in e]
            self.assertEqual(errors, [])

        return ensureDeferred(go())

    def test_recent_rows_show_the_model_as_named_and_its_alias_target(self) -> object:
        async def go() -> None:
            a, b = FakeLlama(models=["tiny-a"]), FakeLlama(models=["tiny-b"])
            evil = FakeLlama(models=["m"])
            urls = [await listen(self, u) for u in (a, b, evil)]
            service, base = await start_crossbar(
                self, _config(*urls, token=False).replace("    hosts: [gpu-a, gpu-b]\n",
                                                          "    hosts: [gpu-a, gpu-b]\n    aliases: {fast: tiny-a}\n"))
            await service.poller.when_first_round_done()
            http = http_client(self)
            browser = await self._browser()
            await browser.get(base + "/_crossbar/")
            await browser.wait(_visible("#board"), 5, "the board")
            # An unknown model (no host lists it: the metrics count it as "other"), an
            # alias, and a hostile name: each row shows what the client sent, as text.
            for model in ("gpt-4o", "fast", EVIL):
                self.assertEqual(await _chat(http, base, model=model), 200)
            rows = await browser.wait(lambda d: (lambda r: r if len(r) == 3 else None)(
                [r for r in _recent_rows(d) if r[1] == "chat"]), 10, "the three requests")
            self.assertEqual([r[3] for r in rows], [EVIL, "fast → tiny-a", "gpt-4o"])  # newest first
            self.assertEqual(await browser.call(lambda d: len(d.find_elements(*_by("#board img")))), 0)
            # The chart's series are told apart by more than colour: dash and marker differ.
            dashes = await browser.call(lambda d: [p.get_attribute("stroke-dasharray") for p in d.find_elements(
                *_by("#chart polyline.series"))])
            self.assertEqual(len(set(dashes)), len(dashes))
            ticks = await browser.call(lambda d: [t.text for t in d.find_elements(*_by("#chart text.tick"))])
            self.assertGreaterEqual(len(ticks), 3)
            label = await browser.call(lambda d: d.find_element(*_by('article.host[data-host="gpu-a"] dt:nth-of-type(2)')).text)
            self.assertIn("1 min", label)
            await browser.screenshot("named-models")
            self.assertEqual(await browser.console_errors(), [])

        return ensureDeferred(go())

    def test_open_without_token_restart_and_phone(self) -> object:
        async def go() -> None:
            a, b, evil = FakeLlama(models=["tiny-a"]), FakeLlama(models=["tiny-b"]), FakeLlama(models=[EVIL])
            urls = [await listen(self, u) for u in (a, b, evil)]
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            text = (f'listen: "tcp:{port}:interface=127.0.0.1"\ndrain: {{delay: 0.001, grace: 0.001}}\n'
                    + _config(*urls, token=False))

            async def start() -> CrossbarService:
                service = make_service(parse_config(text, "test.yaml"))
                service.startService()
                await service.web.when_listening()
                await service.poller.when_first_round_done()
                return service

            services = [await start()]

            async def stop_all() -> None:
                for s in services:
                    if s.running:
                        await s.stopService()

            self.addCleanup(stop_all)
            base = f"http://127.0.0.1:{port}"
            browser = await self._browser(390, 844, phone=True)
            await browser.get(base + "/_crossbar/")
            await browser.wait(_visible("#board"), 5, "the board without a login")
            self.assertFalse(await browser.call(lambda d: d.find_element(*_by("#login")).is_displayed()))
            await browser.wait(lambda d: "up" in _host_class("gpu-a")(d).split(), 5, "gpu-a up")
            # No token in the config: no drain button, a note saying why.
            self.assertFalse(await browser.call(
                lambda d: d.find_element(*_by('article.host[data-host="gpu-a"] button.drain')).is_displayed()))
            self.assertTrue(await browser.call(lambda d: d.find_element(*_by("#action-note")).is_displayed()))
            # One column: the page is no wider than the phone.
            width = await browser.call(lambda d: d.execute_script("return document.documentElement.scrollWidth"))
            self.assertLessEqual(width, 390)
            await browser.screenshot("phone")
            self.assertEqual(await browser.console_errors(), [])

            # crossbar restarts: the page says it is reconnecting, then is live again.
            await services[0].stopService()
            await browser.wait(lambda d: "reconnecting" in d.find_element(*_by("#connection")).text, 8,
                               "reconnecting")
            await browser.screenshot("reconnecting")
            services.append(await start())
            http = http_client(self)
            self.assertEqual(await _chat(http, base), 200)
            await browser.wait(lambda d: d.find_element(*_by("#connection")).text == "live", 10, "live again")
            await browser.wait(lambda d: [r for r in _recent_rows(d) if r[1] == "chat"], 10,
                               "a request after the restart")

        return ensureDeferred(go())


class ReadmePictureTests(TestCase):
    """docs/dashboard.png: two real llama-servers (tools/llama_server.py) answering real
    requests for a good 25 seconds (three of the chart's buckets), one of them draining
    at the end, requests under two keys naming a model, an alias and an unknown model.
    Every figure on the picture is one a real host reported."""

    timeout = 240

    def setUp(self) -> None:
        require_chromium(self)
        require_llama_server(self)
        self.servers = [LlamaServer("single"), LlamaServer("single", model=str(model_path("tiny-b")))]
        for server in self.servers:
            self.addCleanup(server.stop)
            server.start(timeout=90)  # blocking, before any reactor work of the test

    def test_overview_with_tokens(self) -> object:
        async def go() -> None:
            a, b = (server.url for server in self.servers)
            service, base = await start_crossbar(self, (
                f"health: {{interval: 0.5, timeout: 5}}\nops: {{token: {TOKEN}}}\n"
                f"hosts:\n  gpu-a: {{url: {a}, max_inflight: 4}}\n  gpu-b: {{url: {b}, max_inflight: 2}}\n"
                "routes:\n  opencode:\n    hosts: [gpu-a, gpu-b]\n    aliases: {fast: tiny-a}\n"
                "    keys:\n      alice: {secret: s-alice}\n      ci: {secret: s-ci}\n"))
            await service.poller.when_first_round_done()
            http = http_client(self)
            browser = await Browser.open(1280, 900)
            self.addCleanup(lambda: ensureDeferred(browser.close()))
            await browser.get(base + "/_crossbar/")
            await browser.wait(_visible("#login"), 5, "the login form")
            await browser.call(lambda d: d.find_element(*_by("#token")).send_keys(TOKEN))
            await browser.call(lambda d: d.find_element(*_by("#login-form button")).click())
            await browser.wait(lambda d: "up" in _host_class("gpu-b")(d).split(), 5, "gpu-b up")
            sent: list[str] = []
            asks = [("tiny-a", "s-alice"), ("tiny-b", "s-ci"), ("fast", "s-alice")]
            for round_ in range(13):
                for model, secret in asks[: 1 + round_ % len(asks)]:
                    if round_ == 7 and model == "tiny-b":
                        model = "gpt-4o"  # no host lists it: still shown as the client named it
                    response = await http.post(base + "/opencode/v1/chat/completions", json={
                        "model": model, "max_tokens": 24 + (round_ * 37) % 100,
                        "messages": [{"role": "user", "content": f"Write a short poem, number {round_}."}],
                    }, headers={"Authorization": f"Bearer {secret}"})
                    self.assertEqual(response.code, 200)
                    await treq.content(response)
                    sent.append(model)
                await deferLater(reactor, 2.0)
            await treq.content(await http.post(base + "/_crossbar/hosts/gpu-a/drain",
                                               headers={"Authorization": f"Bearer {TOKEN}"}))
            await browser.wait(lambda d: "draining" in _host_class("gpu-a")(d).split(), 10, "gpu-a draining")
            rows = await browser.wait(lambda d: (lambda r: r if len(r) == len(sent) else None)(
                [row for row in _recent_rows(d) if row[1] == "opencode"]), 10, "every request listed")
            # Each row's model as sent (an alias with its target), tokens
            # (processed+cached/generated) and tok/s, as the real hosts said.
            self.assertEqual([row[3] for row in rows], [
                "fast → tiny-a" if m == "fast" else m for m in reversed(sent)])
            for row in rows:
                self.assertRegex(row[9], r"^\d+\+\d+/\d+$")
                self.assertRegex(row[10], r"^\d+(\.\d)?$")
            # The cards' one-minute averages are above zero.
            tps = await browser.call(lambda d: [dd.text for dd in d.find_elements(
                *_by("article.host dd.tps"))])
            self.assertTrue(any(t not in ("0.0", "0") for t in tps), tps)
            await deferLater(reactor, 1.5)  # one more event: the last bucket drawn
            await browser.screenshot("readme")
            self.assertEqual(await browser.console_errors(), [])

        return ensureDeferred(go())


class RealHostBrowserTests(TestCase):
    """The dashboard over a real llama-server host."""

    timeout = 180

    def setUp(self) -> None:
        require_chromium(self)
        require_llama_server(self)
        self.server = LlamaServer("single")
        self.addCleanup(self.server.stop)
        self.server.start(timeout=90)  # blocking, before any reactor work of the test

    def test_real_host_and_a_real_answer_in_the_recent_list(self) -> object:
        async def go() -> None:
            service, base = await start_crossbar(self, (
                "health: {interval: 0.5, timeout: 5}\n"
                f"hosts:\n  llama: {self.server.url}\nroutes:\n  chat:\n    hosts: [llama]\n"))
            await service.poller.when_first_round_done()
            seen: list[Any] = []
            service.requests.observers.append(seen.append)
            browser = await Browser.open()
            self.addCleanup(lambda: ensureDeferred(browser.close()))
            await browser.get(base + "/_crossbar/")
            await browser.wait(lambda d: "up" in _host_class("llama")(d).split(), 5, "llama up")
            loaded = await browser.call(
                lambda d: d.find_element(*_by('article.host[data-host="llama"] dd.loaded')).text)
            self.assertEqual(loaded, "tiny-a")  # what the real server lists
            http = http_client(self)
            response = await http.post(base + "/chat/v1/chat/completions", json={
                "model": "tiny-a", "max_tokens": 8, "messages": [{"role": "user", "content": "Say hi"}]})
            self.assertEqual(response.code, 200)
            await treq.content(response)
            rows = await browser.wait(lambda d: [r for r in _recent_rows(d) if r[1] == "chat"], 10,
                                      "the real answer in the recent list")
            self.assertEqual((rows[0][4], rows[0][5]), ("llama", "200"))
            # Its tokens as the record has them (docs/design.md §What the answers say), else "—".
            figures = token_figures(seen[-1])
            if figures is None:
                self.assertEqual(rows[0][9], "—")
            else:
                self.assertRegex(rows[0][9], re.compile(r"^\d+\+\d+/\d+$"))
            await browser.screenshot("real-host")
            self.assertEqual(await browser.console_errors(), [])

        return ensureDeferred(go())
