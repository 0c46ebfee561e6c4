"""Configuration reload on SIGHUP (docs/design.md §Operations), one path for both process
models.

:func:`next_config` decides whether a reload happens and with which config, for the
single process (:meth:`CrossbarService.reload <crossbar.process.service.CrossbarService.reload>`),
the workers' supervisor (:meth:`Supervisor.reload <crossbar.process.supervisor.Supervisor.reload>`)
and each worker alike: an invalid file is refused (logged, the running config kept),
and what only a restart can apply (``listen``, ``workers``) is logged and kept as it
runs. What a process then does with the accepted config is its own: the single process
and a worker swap it in, the supervisor hands it to its workers.

:func:`plan_reload` is the pure part: what changes between the running and the new
:class:`~crossbar.config.Config`. :class:`SIGHUPReload` is the service that turns a
SIGHUP into a call on the reactor thread (``twistd`` itself does nothing on SIGHUP):
the handler only schedules the reload with ``reactor.callFromThread``, which is safe
from a signal handler and wakes the reactor. The previous handler is put back when the
service stops.
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass, replace
from types import FrameType
from typing import Any, Callable

from twisted.application.service import Service
from twisted.logger import Logger

from crossbar.config import Config, ConfigError, load_config, parse_config
from crossbar.process.listen import listen_endpoint

__all__ = ["ReloadPlan", "SIGHUPReload", "catch_second_stop_signal", "next_config", "plan_reload"]

REFUSED = "reload refused, keeping the running config: {error}"
"""The log line of every refused reload (the running config stays)."""


def next_config(
    running: Config, reactor: Any, log: Logger, text: str | None = None,
    check: Callable[[Config], None] | None = None, said: bool = False,
) -> Config | None:
    """The config a reload of ``running`` swaps in, or None when it is refused.

    Reads ``running.source`` again (or validates ``text``: a worker's snapshot of what
    its supervisor accepted). Refused, with one error line on ``log``: a file that does
    not load, a new ``listen`` that start-up would refuse, or what ``check`` raises
    (:class:`~crossbar.config.ConfigError`) for the config to be swapped in. ``listen``,
    ``workers`` and ``cluster`` apply only at a restart: a change is logged as a warning and the
    running value kept (docs/design.md §Operations).

    :param reactor: parses a new ``listen`` (:func:`~crossbar.process.listen.listen_endpoint`).
    :param log: where the refusal and the warnings go (the caller's namespace).
    :param said: the warnings (the config's, and what needs a restart) were said already:
        a worker's reload of the snapshot its supervisor validated and warned about once
        for every worker.
    """
    try:
        new = parse_config(text, running.source) if said and text is not None else load_config(running.source, text=text)
        if new.listen != running.listen:
            listen_endpoint(reactor, new)  # a file start-up would refuse is refused
        kept = replace(new, listen=running.listen, workers=running.workers, cluster=running.cluster)
        if check is not None:
            check(kept)
    except ConfigError as e:
        log.error(REFUSED, error=str(e))
        return None
    if said:
        return kept
    if new.listen != running.listen:
        log.warn("reload: listen changed from {old} to {new}; a restart is needed to apply it",
                 old=running.listen, new=new.listen)
    if new.workers != running.workers:
        log.warn("reload: workers changed from {old} to {new}; a restart is needed to apply it",
                 old=running.workers, new=new.workers)
    if new.cluster != running.cluster:
        log.warn("reload: cluster changed; a restart is needed to apply it")
    return kept


@dataclass(frozen=True)
class ReloadPlan:
    """What a reload from one config to another does. Hosts in neither tuple keep
    their health.

    :ivar fresh: hosts that are new or whose connection settings (URL, ``tls``,
        ``api_key``: :meth:`~crossbar.config.Host.connection_settings`) changed: they
        start over (unhealthy, polled at once), docs/design.md §Operations.
    :ivar removed: hosts no longer configured.
    :ivar listen_changed: ``listen`` differs; it cannot change without a restart.
    :ivar changed: hosts in both configs with any setting changed (``weight``,
        ``max_inflight``, or a connection setting), for the summary a reload logs.
    """

    fresh: tuple[str, ...]
    removed: tuple[str, ...]
    listen_changed: bool
    changed: tuple[str, ...] = ()

    def summary(self) -> str:
        """The hosts part of the line a reload logs, e.g. ``0 new, 1 changed (0 start
        over), 0 removed``: a host whose weight changed is counted, not only a new one."""
        new = sum(1 for n in self.fresh if n not in self.changed)
        over = len(self.fresh) - new
        return f"{new} new, {len(self.changed)} changed ({over} start over), {len(self.removed)} removed"


def plan_reload(old: Config, new: Config) -> ReloadPlan:
    """Compare the running config ``old`` with ``new`` (both already validated).

    A change of weight, ``max_inflight``, routes or keys does not make a host fresh:
    those apply to the next request without touching its health.
    """
    fresh = tuple(
        n for n, h in new.hosts.items()
        if n not in old.hosts or old.hosts[n].connection_settings() != h.connection_settings()
    )
    removed = tuple(n for n in old.hosts if n not in new.hosts)
    changed = tuple(n for n, h in new.hosts.items() if n in old.hosts and old.hosts[n] != h)
    return ReloadPlan(fresh=fresh, removed=removed, listen_changed=old.listen != new.listen, changed=changed)


class SIGHUPReload(Service):
    """Calls ``reload()`` on the reactor thread for every SIGHUP while running.

    :param reload: what to do (e.g. :meth:`CrossbarService.reload`); exceptions are logged.
    :param reactor: provides ``callFromThread``.
    """

    _log = Logger(namespace="crossbar")

    def __init__(self, reload: Callable[[], object], reactor: Any) -> None:
        self._reload = reload
        self._reactor = reactor
        self._previous: Any = None
        self._installed = False

    def startService(self) -> None:
        super().startService()
        if threading.current_thread() is not threading.main_thread():
            self._log.warn("not on the main thread: SIGHUP reload is off")
            return
        self._previous = signal.signal(signal.SIGHUP, self._on_signal)
        self._installed = True

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._reactor.callFromThread(self._run)

    def _run(self) -> None:
        try:
            self._reload()
        except Exception:
            self._log.failure("reloading the configuration failed")

    def stopService(self) -> None:
        super().stopService()
        if self._installed:
            self._installed = False
            previous = self._previous if self._previous is not None else signal.SIG_DFL
            signal.signal(signal.SIGHUP, previous)


def catch_second_stop_signal(reactor: Any, hurry: Callable[[], object]) -> None:
    """From now on (a drain has started), SIGTERM and SIGINT call ``hurry`` on the
    reactor thread instead of Twisted's ``reactor.stop`` (which would only log a
    ``ReactorNotRunning`` traceback): a second signal ends the drain at once
    (docs/design.md §Operations). Does nothing off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return

    def on_signal(signum: int, frame: FrameType | None) -> None:
        reactor.callFromThread(hurry)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
