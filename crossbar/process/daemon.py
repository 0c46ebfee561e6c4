"""What ``twistd crossbar`` runs (docs/design.md §Shape, §Workers).

:func:`make_daemon` builds one :class:`~crossbar.process.service.CrossbarService` with
signal handling, or with ``workers`` > 1 a
:class:`~crossbar.process.supervisor.Supervisor` of that many, after the start-up
steps that concern the whole process (the Twisted fence's check, the log time stamps,
the reactor's dispatch). It is the one module that knows both: ``daemon -> service``
and ``daemon -> supervisor``, so neither imports the other.
"""

from __future__ import annotations

from typing import Any, Mapping

from twisted.application.service import MultiService
from twisted.logger import Logger

from crossbar.compat import prometheus, txredis
from crossbar.compat.twisted import cache_log_timestamps, lean_dispatch, log_fallback
from crossbar.config import Config
from crossbar.process.supervisor import WorkerTimings, make_supervisor

__all__ = ["logs_json_lines", "logs_text", "make_daemon"]


def logs_json_lines(twistd: Mapping[str, Any] | None) -> bool:
    """twistd's options (None: not run by twistd) say its log is
    :func:`crossbar.ops.jsonlog.observer`'s JSON lines on standard output, which workers
    can then write to themselves. twistd has replaced the ``--logger`` name by the
    factory it names by the time a plugin sees its options; the name is taken too."""
    from crossbar.ops import jsonlog

    logger = (twistd or {}).get("logger")
    return logger is jsonlog.observer or logger == "crossbar.ops.jsonlog.observer"


def logs_text(twistd: Mapping[str, Any] | None) -> bool:
    """twistd's options (None: not run by twistd) say its log is its own text log
    (``--logfile`` or standard output: no ``--logger``, no ``--syslog``), whose lines
    workers can then format themselves (the supervisor then relays none of them)."""
    return twistd is not None and not twistd.get("logger") and not twistd.get("syslog")


def make_daemon(config: Config, twistd: Mapping[str, Any] | None = None, stall: float | None = None) -> MultiService:
    """What ``twistd crossbar`` runs for ``config``: one :class:`~crossbar.process.service.CrossbarService` with
    signal handling, or with ``workers`` > 1 a :class:`~crossbar.process.supervisor.Supervisor`
    of that many (docs/design.md §Workers). ``twistd`` is twistd's own options: when its
    ``--logger`` is :func:`crossbar.ops.jsonlog.observer`, workers log straight to the same
    standard output. ``stall``: seconds a ready worker may be silent before it is killed (the
    plugin's ``--worker-stall``; default :data:`~crossbar.process.supervisor.STALL`).

    :raises ConfigError: as :func:`~crossbar.process.service.make_service` and :class:`~crossbar.process.supervisor.Supervisor`.
    """
    log = Logger(namespace="crossbar")
    log_fallback(log)  # an unchecked Twisted: its own behaviour, said once
    if prometheus.FALLBACK is not None:
        log.warn("{why}: using its public inc and observe (slower, same figures)", why=prometheus.FALLBACK)
    if config.cluster is not None and txredis.FALLBACK is not None:
        log.warn("{why}: connecting to Redis as txredisapi itself does (a log line per reconnection attempt)",
                 why=txredis.FALLBACK)
    cache_log_timestamps()  # twistd's text log: its time stamp formatted once per second
    from twisted.internet import reactor

    lean_dispatch(reactor)  # no log.callWithLogger layers per ready descriptor
    if config.workers > 1:
        timings = WorkerTimings() if stall is None else WorkerTimings.with_stall(stall)
        return make_supervisor(config, log_through=logs_json_lines(twistd), timings=timings, text_log=logs_text(twistd))
    # Imported here: a supervisor never serves, and without the proxy, the operations
    # app and their libraries its interpreter keeps ~8 MiB less (its workers import them).
    from crossbar.process.service import make_service

    return make_service(config, handle_signals=True)
