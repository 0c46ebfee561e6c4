"""A real headless Chromium for the dashboard's tests (Debian's ``chromium`` and
``chromium-driver``, driven by selenium).

Selenium's calls block, and the crossbar under test runs on this process's reactor:
every browser call runs on a thread (:meth:`Browser.call`) so the reactor keeps
serving. :func:`require_chromium` skips a test when no Chromium can be had, and fails it
under ``CI=true``. Screenshots go to ``$CROSSBAR_ARTIFACTS/dashboard/`` (default
``$TMPDIR/crossbar-artifacts/dashboard/``)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from typing import Any, Callable, TypeVar

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SkipTest, SynchronousTestCase

__all__ = ["Browser", "artifacts_dir", "require_chromium", "table_rows"]

T = TypeVar("T")

_CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
_DRIVER = ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver")


def _first(paths: tuple[str, ...], name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    return next((p for p in paths if os.access(p, os.X_OK)), None)


def _skip_reason() -> str | None:
    if importlib.util.find_spec("selenium") is None:
        return "selenium is not installed (pip install '.[test]')"
    if _first(_CHROMIUM, "chromium") is None:
        return "no chromium (apt-get install chromium chromium-driver)"
    if _first(_DRIVER, "chromedriver") is None:
        return "no chromedriver (apt-get install chromium-driver)"
    return None


def require_chromium(case: SynchronousTestCase) -> None:
    """Skip ``case`` without selenium, chromium or chromedriver; fail it under CI=true."""
    reason = _skip_reason()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        case.fail(f"CI=true requires a headless Chromium: {reason}")
    raise SkipTest(reason)


def artifacts_dir() -> str:
    """Where screenshots go (made if missing)."""
    root = os.environ.get("CROSSBAR_ARTIFACTS") or os.path.join(tempfile.gettempdir(), "crossbar-artifacts")
    path = os.path.abspath(os.path.join(root, "dashboard"))
    os.makedirs(path, exist_ok=True)
    return path


_ROWS = """
var key = arguments[1];
return Array.from(document.querySelectorAll(arguments[0])).map(function (tr) {
  return [key ? tr.getAttribute(key) : null,
          Array.from(tr.cells).map(function (td) { return td.innerText.trim(); })];
});"""


def table_rows(driver: Any, selector: str, key: str | None = None) -> list[tuple[str | None, list[str]]]:
    """The rows ``selector`` finds, each as its ``key`` attribute (None without one) and
    its cells' text, read in one script call. The page redraws live: a look of one
    WebDriver call per cell outlasted a redraw on a loaded machine, and every look then
    ended on a stale element."""
    found: list[list[Any]] = driver.execute_script(_ROWS, selector, key)
    return [(k, cells) for k, cells in found]


class Browser:
    """One headless Chromium window (``width`` x ``height`` CSS pixels)."""

    def __init__(self, width: int = 1280, height: int = 900, phone: bool = False) -> None:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        options = webdriver.ChromeOptions()
        binary = _first(_CHROMIUM, "chromium")
        assert binary is not None
        options.binary_location = binary
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                    f"--window-size={width},{height}", "--disable-extensions", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update"):
            options.add_argument(arg)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        if phone:  # a desktop window cannot be made that narrow: emulate the device
            options.add_experimental_option("mobileEmulation", {
                "deviceMetrics": {"width": width, "height": height, "pixelRatio": 2, "touch": True},
                "userAgent": "Mozilla/5.0 (Linux; Android 14; Pixel 8) AppleWebKit/537.36 (KHTML, like Gecko) "
                             "Chrome/150.0 Mobile Safari/537.36",
            })
        driver = _first(_DRIVER, "chromedriver")
        assert driver is not None
        self.driver: Any = webdriver.Chrome(service=Service(executable_path=driver), options=options)
        self.driver.set_page_load_timeout(20)

    @classmethod
    async def open(cls, width: int = 1280, height: int = 900, phone: bool = False) -> Browser:
        """Start a browser (on a thread: it takes a second or two); ``phone``: emulate
        a phone of ``width`` x ``height``."""
        return await deferToThread(cls, width, height, phone)

    def call(self, f: Callable[..., T], *args: Any) -> Deferred[T]:
        """Run ``f(driver, *args)`` on a thread."""
        return deferToThread(f, self.driver, *args)

    async def get(self, url: str) -> None:
        await self.call(lambda d: d.get(url))

    async def wait(self, predicate: Callable[[Any], Any], timeout: float, what: str, step: float = 0.1) -> Any:
        """Poll ``predicate(driver)`` (on a thread) until it is truthy; fail after
        ``timeout`` seconds naming ``what``."""
        deadline = reactor.seconds() + timeout  # type: ignore[attr-defined]
        last: Any = None
        while True:
            try:
                last = await self.call(predicate)
            except Exception as e:  # an element replaced between two looks: look again
                last = e
            if last and not isinstance(last, Exception):
                return last
            if reactor.seconds() > deadline:  # type: ignore[attr-defined]
                raise AssertionError(f"{what} not seen within {timeout}s (last: {last!r})")
            await deferLater(reactor, step)

    async def console_errors(self) -> list[str]:
        """The browser console's SEVERE entries since the last call."""
        logs = await self.call(lambda d: d.get_log("browser"))
        return [entry["message"] for entry in logs if entry.get("level") == "SEVERE"]

    async def screenshot(self, name: str) -> str:
        """Save the whole page (not only the window) as
        ``<artifacts>/dashboard/<name>.png``; returns the path."""
        path = os.path.join(artifacts_dir(), f"{name}.png")

        def shoot(d: Any) -> None:
            import base64

            metrics = d.execute_cdp_cmd("Page.getLayoutMetrics", {})
            size = metrics["cssContentSize"]
            shot = d.execute_cdp_cmd("Page.captureScreenshot", {
                "format": "png", "captureBeyondViewport": True,
                "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1},
            })
            with open(path, "wb") as f:
                f.write(base64.b64decode(shot["data"]))

        await self.call(shoot)
        return path

    async def close(self) -> None:
        await self.call(lambda d: d.quit())
