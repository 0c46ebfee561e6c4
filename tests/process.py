"""A real ``twistd -n crossbar`` subprocess for process-level tests (signals, drain,
reload, logging, systemd).

:func:`start_twistd` writes the config to a temporary file, spawns
``twistd -n --pidfile= [--logger ...] crossbar --config FILE`` with the
checkout on ``PYTHONPATH`` through ``reactor.spawnProcess`` (so the test's reactor keeps
serving the loopback upstreams meanwhile), learns the port from the ``listening on``
log line (the config listens on port 0) and kills the process at the end of the test
if it is still running.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, Callable, Sequence

import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import deferLater
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase

from tests.harness import http_client, wait_for

__all__ = ["START", "Twistd", "start_twistd", "twistd_argv", "twistd_env"]

START = 60.0
"""Seconds a crossbar process (twistd, or a worker it starts) may take to listen or be
ready: ~1 s of imports on a quiet machine, but over 20 s was seen with the suite in
parallel beside other work on 2 cores. Only a failing wait lasts this long."""

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LISTENING = re.compile(r"listening on (?:127\.0\.0\.1|::1):(\d+)")


# ``python -m twisted`` is the newer ``twist`` runner (no -n, no --logger): run twistd's
# own entry point instead. A non-editable install of this project puts its own copy of
# crossbar_plugin.py into site-packages' twisted/plugins, which comes first in
# ``twisted.plugins.__path__``: put the checkout's plugin directory first so the code
# under test is the code that runs.
_TWISTD = (
    "import sys, twisted.plugins as p; p.__path__.insert(0, sys.argv.pop(1)); "
    "sys.argv[0] = 'twistd'; from twisted.scripts.twistd import run; run()"
)


def twistd_argv(config_path: str, options: Sequence[str] = ("-n", "--pidfile="), logger: str | None = None,
                plugin_options: Sequence[str] = ()) -> list[str]:
    """The command line of ``twistd OPTIONS [--logger=LOGGER] crossbar --config FILE
    PLUGIN_OPTIONS`` for this checkout."""
    args = [sys.executable, "-c", _TWISTD, os.path.join(ROOT, "twisted", "plugins"), *options]
    if logger:
        args.append(f"--logger={logger}")
    return args + ["crossbar", "--config", config_path, *plugin_options]


def twistd_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a twistd child: the checkout first on
    ``PYTHONPATH``, unbuffered output, no bytecode written, no systemd variables of our
    own (a test passes its own in ``extra``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(extra or {})
    return env


class Twistd(ProcessProtocol):
    """The subprocess: its output lines so far and how it ended.

    :ivar out: standard output lines (the log, or JSON lines with ``--logger``).
    :ivar err: standard error lines.
    :ivar ended: fires with ``(exit code or None, signal or None)``.
    :ivar ended_at: reactor time the process ended, or None.
    """

    def __init__(self) -> None:
        self.out: list[str] = []
        self.err: list[str] = []
        self._partial = {1: b"", 2: b""}
        self.ended: Deferred[tuple[int | None, int | None]] = Deferred()
        self.ended_at: float | None = None
        self.exit: tuple[int | None, int | None] | None = None
        self.port: int | None = None
        self._watchers: list[tuple[Callable[[str], bool], Deferred[str]]] = []
        self.config_path = ""

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def childDataReceived(self, fd: int, data: bytes) -> None:
        buf = self._partial.get(fd, b"") + data
        *lines, self._partial[fd] = buf.split(b"\n")
        for raw in lines:
            line = raw.decode("utf-8", "replace")
            (self.out if fd == 1 else self.err).append(line)
            if self.port is None:
                m = _LISTENING.search(line)
                if m:
                    self.port = int(m.group(1))
            for watcher in list(self._watchers):
                predicate, d = watcher
                if predicate(line):
                    self._watchers.remove(watcher)
                    d.callback(line)

    def processEnded(self, reason: Failure) -> None:
        self.ended_at = reactor.seconds()  # type: ignore[attr-defined]
        value = reason.value
        if isinstance(value, ProcessDone):
            self.exit = (0, None)
        elif isinstance(value, ProcessTerminated):
            self.exit = (value.exitCode, value.signal)
        else:
            self.exit = (None, None)
        for _, d in self._watchers:
            d.errback(AssertionError("twistd ended; output:\n" + self.text()))
        self._watchers = []
        self.ended.callback(self.exit)

    def text(self) -> str:
        return "\n".join(self.out + ["--- stderr ---"] + self.err)

    def line(self, predicate: Callable[[str], bool], timeout: float = 20.0, what: str = "") -> Deferred[str]:
        """Fires with the first output line (already seen or future) ``predicate`` accepts;
        fails naming ``what`` it waited for (when given) if none comes within
        ``timeout`` seconds or the process ends."""
        for line in self.out + self.err:
            if predicate(line):
                d: Deferred[str] = Deferred()
                d.callback(line)
                return d
        d = Deferred()
        waited = f" (waiting for: {what})" if what else ""
        if self.exit is not None:
            d.errback(AssertionError(f"twistd ended{waited}; output:\n" + self.text()))
            return d
        self._watchers.append((predicate, d))
        timer = reactor.callLater(timeout, self._expire, d, f"no line of {what} within {timeout}s" if what else "")  # type: ignore[attr-defined]
        d.addBoth(lambda r: (timer.cancel() if timer.active() else None, r)[1])
        return d

    def _expire(self, d: Deferred[str], what: str) -> None:
        for watcher in list(self._watchers):
            if watcher[1] is d:
                self._watchers.remove(watcher)
                d.errback(AssertionError((what or "no such line in time") + "; output:\n" + self.text()))

    def signal(self, sig: int) -> None:
        assert self.transport is not None
        self.transport.signalProcess(sig)


async def start_twistd(
    case: TestCase,
    config_yaml: str,
    env: dict[str, str] | None = None,
    logger: str | None = None,
    ready: bool = True,
    child_fds: dict[int, Any] | None = None,
    argv_prefix: list[str] | None = None,
    plugin_options: Sequence[str] = (),
) -> Twistd:
    """Spawn crossbar under twistd for ``config_yaml`` (``listen`` defaults to a free
    loopback port), with ``plugin_options`` after ``--config FILE`` (e.g.
    ``--worker-stall``). Waits for the listening line and, if ``ready``, for readyz 200."""
    if not any(line.startswith("listen:") for line in config_yaml.splitlines()):
        config_yaml = 'listen: "tcp:0:interface=127.0.0.1"\n' + config_yaml
    directory = os.path.abspath(case.mktemp())
    os.makedirs(directory)
    path = os.path.join(directory, "crossbar.yaml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(config_yaml)
    proc = Twistd()
    proc.config_path = path
    args = (argv_prefix or []) + twistd_argv(path, logger=logger, plugin_options=plugin_options)
    reactor.spawnProcess(  # type: ignore[attr-defined]
        proc, args[0], args, env=twistd_env(env), path=ROOT,
        childFDs=child_fds or {0: "w", 1: "r", 2: "r"},
    )

    async def cleanup() -> None:
        if proc.exit is None:
            try:
                proc.signal("KILL")
            except Exception:
                pass
            await proc.ended

    case.addCleanup(cleanup)
    await proc.line(lambda line: _LISTENING.search(line) is not None or '"listening on' in line,
                     timeout=START, what="the listening line")
    if proc.port is None:  # JSON log: the address is a field
        for line in proc.out:
            m = re.search(r'"address": "(?:127\.0\.0\.1|::1):(\d+)"', line)
            if m:
                proc.port = int(m.group(1))
    assert proc.port is not None, proc.text()
    if ready:
        http = http_client(case)

        async def is_ready() -> bool:
            response = await http.get(proc.base + "/_crossbar/readyz")
            await treq.content(response)
            return bool(response.code == 200)

        await wait_for(is_ready, START, "readyz 200")
    return proc


class ClientStream:
    """One streaming request read chunk by chunk: :attr:`done` fires with
    ``("complete" | "cut", body bytes)``; :attr:`first` fires at the first chunk."""

    def __init__(self, http: Any, url: str, n: int, delay: float) -> None:
        from twisted.internet.defer import ensureDeferred

        self.chunks: list[bytes] = []
        self.first: Deferred[None] = Deferred()
        self.done: Deferred[tuple[str, bytes]] = ensureDeferred(self._run(http, url, n, delay))

    def _got(self, data: bytes) -> None:
        self.chunks.append(data)
        if not self.first.called:
            self.first.callback(None)

    async def _run(self, http: Any, url: str, n: int, delay: float) -> tuple[str, bytes]:
        body = {"model": "tiny-a", "stream": True, "n": n, "delay": delay, "messages": []}
        try:
            response = await http.post(url, json=body, unbuffered=True)
            if response.code != 200:
                raise AssertionError(f"HTTP {response.code}")
            await treq.collect(response, self._got)
        except Exception:
            if not self.first.called:
                self.first.errback(Failure())
            return "cut", b"".join(self.chunks)
        return "complete", b"".join(self.chunks)

    @staticmethod
    def events(body: bytes) -> list[int]:
        """The indexes of the SSE events in ``body``, in order."""
        import json

        out = []
        for block in body.split(b"\n\n"):
            if block.startswith(b"data: {"):
                out.append(json.loads(block[6:])["i"])
        return out
