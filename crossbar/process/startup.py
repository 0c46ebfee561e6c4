"""Fail fast at start-up with one line, never a traceback (docs/design.md §Configuration).

A bad configuration file, a ``listen`` string Twisted cannot parse, or a ``listen``
address that cannot be bound (port in use, no such interface) must stop ``twistd`` at
start-up with one line ``crossbar: FILE: KEY: problem`` on stderr and exit status 1.
Errors raised while building the service are reported by the plugin with
:func:`report_and_exit`; errors raised while *starting* it (binding the port happens in
``startService``, after ``twistd`` has redirected ``sys.stderr`` into its log) are caught
by :class:`StartupGuard`, which wraps the service ``twistd`` runs.
"""

from __future__ import annotations

import os
import sys
from functools import partial
from typing import Any, Callable, Mapping, MutableMapping, NoReturn, TextIO

from twisted.application.service import IService, MultiService
from twisted.internet.error import CannotListenError
from twisted.logger import Logger

from crossbar.config import ConfigError

__all__ = ["StartupGuard", "as_config_error", "check_config", "log_is_terminal", "report_and_exit"]

_log = Logger(namespace="crossbar")


def as_config_error(error: ConfigError | CannotListenError, source: str) -> ConfigError:
    """``error`` as a :class:`ConfigError` of the file ``source``.

    A :class:`CannotListenError` becomes a problem of the ``listen`` key, e.g.
    ``crossbar.yaml: listen: cannot listen on 127.0.0.1:7777: Address already in use``.
    """
    if isinstance(error, ConfigError):
        return error
    reason = error.socketError
    why = getattr(reason, "strerror", None) or str(reason) or type(reason).__name__
    if error.port is None:  # raised by ListenService for errors other than bind's
        return ConfigError(source, "listen", f"cannot listen: {why}")
    where = f"{error.interface or '*'}:{error.port}"
    return ConfigError(source, "listen", f"cannot listen on {where}: {why}")


def check_config(path: str, stdout: TextIO, stderr: TextIO) -> int:
    """``twistd crossbar --config PATH --check``: validate the file without starting.

    Loads and validates the config as a start would (every check of docs/design.md
    §Configuration) and parses its ``listen`` endpoint (an ``ssl:`` listener's key and
    certificate files are read; a ``systemd:`` one is not looked up, it exists only
    under systemd). Nothing is bound and no host is contacted.

    :returns: 0 after writing ``crossbar: PATH: ok`` to ``stdout`` (after the warning
        lines a start would log, ``crossbar: warning: FILE: KEY: problem``, on
        ``stderr``: settings that load but are probably mistakes), else 1 after writing
        the one line a failed start would, ``crossbar: FILE: KEY: problem``, to ``stderr``.
    """
    from twisted.internet import reactor

    from crossbar.config import parse_config, read_config_text
    from crossbar.process.listen import listen_endpoint

    try:
        config = parse_config(read_config_text(path), path)
        if not config.listen.startswith("systemd:"):
            listen_endpoint(reactor, config)
    except ConfigError as e:
        stderr.write(f"crossbar: {e}\n")
        return 1
    for warning in config.warnings:
        stderr.write(f"crossbar: warning: {warning}\n")
    shown = f" ({len(config.warnings)} warning{'s' if len(config.warnings) > 1 else ''})" if config.warnings else ""
    stdout.write(f"crossbar: {path}: ok{shown}\n")
    return 0


def log_is_terminal(twistd: Mapping[str, Any] | None) -> bool:
    """Whether twistd's log goes to this process's standard output, where the one line
    :func:`report_and_exit` writes to stderr already tells the reader (a critical log
    event as well would print the error twice).

    ``twistd`` is twistd's option mapping (``ServerOptions``) or None (not under twistd:
    False). True for ``-n`` without ``--logfile`` (or ``--logfile=-``) and for
    ``--logger=crossbar.ops.jsonlog.observer`` (JSON lines on stdout); False for a log file
    (``--logfile``, or a daemon's ``twistd.log``), ``--syslog`` and any other
    ``--logger``, whose destination crossbar cannot know.
    """
    if twistd is None or twistd.get("syslog"):
        return False
    logger = twistd.get("logger")
    if logger:
        from crossbar.ops import jsonlog

        return logger is jsonlog.observer
    if not twistd.get("nodaemon"):
        return False
    return twistd.get("logfile") in (None, "", "-")


def report_and_exit(
    error: ConfigError,
    stderr: TextIO | None = None,
    log: bool = True,
    twistd: MutableMapping[str, Any] | None = None,
) -> NoReturn:
    """Write ``crossbar: <error>`` as one line to ``stderr`` and exit with status 1.

    ``stderr`` defaults to the process's original standard error (``sys.__stderr__``),
    which ``twistd`` leaves alone when it redirects ``sys.stderr`` into its log. With
    ``log`` the same line is also logged at ``critical`` level for operators who read
    the log file (pass False before ``twistd`` has started logging: Twisted would print
    a critical event to stderr a second time).

    ``twistd`` is twistd's own option mapping (``ServerOptions``), when running under
    it: a daemonized twistd's parent waits on a status pipe for the child's verdict and
    hangs for ever when the child exits without one, so the line is written there (the
    parent prints it and exits 1); and the pidfile this process wrote is removed.

    :raises SystemExit: always, with code 1.
    """
    line = f"crossbar: {error}"
    if log:
        _log.critical("start-up failed: {error}", error=str(error))
    out = stderr if stderr is not None else (sys.__stderr__ or sys.stderr)
    out.write(line + "\n")
    out.flush()
    if twistd is not None:
        _tell_twistd(twistd, line)
    raise SystemExit(1)


def _tell_twistd(twistd: MutableMapping[str, Any], line: str) -> None:
    pipe = twistd.get("statusPipe")
    if pipe is not None:
        twistd["statusPipe"] = None
        try:
            # twistd's protocol: b"0" is success, b"1 <message>" failure (<= 100 bytes).
            os.write(pipe, b"1 " + line.encode("ascii", "backslashreplace")[:98])
            os.close(pipe)
        except OSError:
            pass  # the parent is gone: nobody is waiting
    pidfile = twistd.get("pidfile")
    if pidfile:
        try:
            with open(pidfile, encoding="ascii") as f:
                ours = f.read().strip() == str(os.getpid())
            if ours:
                os.remove(pidfile)
        except (OSError, UnicodeDecodeError):
            pass  # none written yet, or not ours to remove


class StartupGuard(MultiService):
    """Runs ``service``; a start-up error becomes one line and exit status 1.

    Catches :class:`ConfigError` and :class:`CannotListenError` from
    ``privilegedStartService`` and ``startService`` (``source`` is the configuration
    file named in the message) and hands them, as :class:`ConfigError`, to ``report``
    (default :func:`report_and_exit` told about ``twistd``, twistd's option mapping,
    logging the line too only when the log does not go to the terminal, see
    :func:`log_is_terminal`: one line either way); any other exception is a bug and
    propagates.
    """

    def __init__(
        self,
        service: IService,
        source: str,
        report: Callable[[ConfigError], NoReturn] | None = None,
        twistd: MutableMapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.source = source
        self._report = report if report is not None else partial(
            report_and_exit, twistd=twistd, log=not log_is_terminal(twistd)
        )
        service.setServiceParent(self)

    def privilegedStartService(self) -> None:
        try:
            super().privilegedStartService()
        except (ConfigError, CannotListenError) as e:
            self._report(as_config_error(e, self.source))

    def startService(self) -> None:
        try:
            super().startService()
        except (ConfigError, CannotListenError) as e:
            self._report(as_config_error(e, self.source))
