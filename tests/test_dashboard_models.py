"""The dashboard's hosts x models view (docs/design.md §Where models live, §Operations):
its data (``models`` of ``dashboard.json``) and, in a real headless Chromium, the table:
loaded, loading and available per host and model, requests in flight, the last load and
unload with their reason, a hostile model id shown as text."""

from __future__ import annotations

from typing import Any

import treq
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.trial.unittest import TestCase

from crossbar.process.service import CrossbarService
from tests.browser import Browser, require_chromium, table_rows
from tests.fake_router import FakeRouter
from tests.harness import http_client, listen, start_crossbar, wait_for

EVIL = "<img src=x onerror=alert(1)>"


class ModelsViewTests(TestCase):
    timeout = 120

    async def fleet(self) -> tuple[CrossbarService, str, FakeRouter, FakeRouter]:
        a, b = FakeRouter(["m1", "m2", EVIL], models_max=2, load_time=30), FakeRouter(["m1", "m2"], models_max=2)
        a.state.update(m1="loaded")
        self.addCleanup(a.stop)
        self.addCleanup(b.stop)
        urls = [await listen(self, r) for r in (a, b)]
        text = (f"health: {{interval: 0.2, timeout: 2}}\nhosts:\n  a: {{url: \"{urls[0]}\", models_max: 2}}\n"
                f"  b: {{url: \"{urls[1]}\", models_max: 3}}\n"
                "routes:\n  r:\n    hosts: [a, b]\n    placement: {keep_loaded: [m2]}\n")
        service, base = await start_crossbar(self, text)
        await service.poller.when_first_round_done()
        await wait_for(lambda: service.runtime.placement.last_load, what="m2 kept loaded")
        return service, base, a, b

    def test_data(self) -> Deferred[None]:
        async def go() -> None:
            service, base, a, b = await self.fleet()
            doc: Any = await treq.json_content(await http_client(self).get(base + "/_crossbar/dashboard.json"))
            view = doc["models"]
            self.assertEqual(view["models"][:2], ["m1", "m2"])  # held somewhere first
            self.assertIn(EVIL, view["models"])
            hosts = {h["name"]: h for h in view["hosts"]}
            self.assertEqual(hosts["a"]["cells"]["m1"], {"state": "loaded", "inflight": 0})
            self.assertEqual((hosts["a"]["models_max"], hosts["b"]["models_max"]), (2, 3))
            keeper = service.runtime.placement.last_load
            (name,) = keeper
            self.assertEqual(hosts[name]["last_load"]["model"], "m2")
            self.assertEqual(hosts[name]["last_load"]["reason"], "keep")
            self.assertIn(hosts[name]["cells"]["m2"]["state"], ("loading", "loaded"))
        return ensureDeferred(go())

    def test_table_in_a_browser(self) -> Deferred[None]:
        require_chromium(self)

        async def go() -> None:
            from selenium.webdriver.common.by import By
            service, base, a, b = await self.fleet()
            browser = await Browser.open(1280, 900, False)
            self.addCleanup(lambda: ensureDeferred(browser.close()))
            await browser.get(base + "/_crossbar/")

            def rows(d: Any) -> dict[str | None, list[str]]:
                return dict(table_rows(d, "#models tbody tr", "data-host"))

            await browser.wait(lambda d: len(rows(d)) == 2, 10, "the models table")
            # The page redraws live: each look is retried when an element was replaced under it.
            heads = await browser.wait(lambda d: [th.text for th in d.find_elements(By.CSS_SELECTOR, "#models th")],
                                       10, "the models table's head")
            self.assertEqual(heads[:4], ["host", "models max", "m1", "m2"])
            self.assertIn(EVIL, heads)  # as text
            self.assertEqual(await browser.wait(lambda d: d.find_elements(By.CSS_SELECTOR, "#models img") == [] and [0],
                                                10, "no image in the table"), [0])
            found = await browser.wait(rows, 10, "the models table's rows")
            self.assertEqual(found["a"][:3], ["a", "2", "0"])  # m1 loaded on a, none in flight
            keeper = next(iter(service.runtime.placement.last_load))
            await browser.wait(lambda d: "m2 (keep" in " ".join(rows(d)[keeper]), 10, "the last load")
            cls = await browser.wait(lambda d: d.find_element(
                By.CSS_SELECTOR, '#models tr[data-host="a"] td[data-model="m1"]').get_attribute("class"), 10, "a's m1 cell")
            self.assertEqual(cls, "cell loaded")
            self.assertEqual(await browser.console_errors(), [])
            await browser.screenshot("models")
        return ensureDeferred(go())
