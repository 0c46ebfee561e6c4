"""How the log lines of a supervisor's workers reach its log (docs/design.md §Workers).

Workers' log lines reach the supervisor's log without being logged again there, as its
log allows: with the JSON logger each worker writes its lines to the same standard
output; with twistd's text log each worker formats its own text lines
(``[namespace#level worker=N]``) and writes them to the same standard output, or, for a
``--logfile``, the supervisor appends them to the file unread, as they come in batches
(twistd's ``LogFile``, so rotation goes on; touchpoint 11 finds it). Otherwise (no
twistd, or the touchpoint's fallback) they come as JSON and are logged by the
supervisor with a ``worker`` field (:func:`relay_log_line`: ~65 µs of its CPU per
proxied request, measured with bench/cpu_probe.py --workers 2).
"""

from __future__ import annotations

import json
from typing import Any

from twisted.logger import InvalidLogLevelError, Logger, LogLevel
from twisted.python.logfile import BaseLogFile

from crossbar.compat.twisted import text_log_file
from crossbar.config import one_line
from crossbar.ops.emit import emit

__all__ = ["WorkerLog", "relay_log_line"]


class WorkerLog:
    """Where the workers' standard output goes, and what the supervisor does with it.

    :param log_through: the supervisor logs JSON lines to its standard output
        (``twistd --logger crossbar.ops.jsonlog.observer``, as the systemd unit does): the
        workers then write theirs to the same output directly, and nothing is relayed
        (relaying costs the supervisor ~80 µs of CPU per request).
    :param text_log: the supervisor logs twistd's text lines (no ``--logger``, no
        ``--syslog``): workers write theirs in the same format, to the same standard
        output or through a pipe whose bytes the supervisor appends to the log file
        unread (see the module doc); else their JSON lines are relayed.
    :ivar stdout: a worker's descriptor 1 as ``spawnProcess`` takes it: ``1`` (the
        supervisor's own standard output), another descriptor, or ``"r"`` (a pipe read
        by the supervisor, :meth:`received`).
    :ivar mode: how a worker writes its lines (its ``--log``): ``json``, ``text`` or
        ``batched-text``.
    :ivar file: twistd's log file (a ``LogFile``) workers' text lines are appended to,
        unread, or None.
    """

    def __init__(self, log_through: bool, text_log: bool) -> None:
        self.log_through = log_through
        self.text_log = text_log
        self.stdout: int | str = 1 if log_through else "r"
        self.mode = "json"
        self.file: Any = None

    def choose(self) -> None:
        """Decide how workers log (see the module doc): once twistd's log is running."""
        if self.log_through or not self.text_log:
            return
        out = text_log_file()
        if isinstance(out, BaseLogFile):
            self.file, self.mode = out, "batched-text"
            return
        try:
            fd = out.fileno() if out is not None else None
        except (AttributeError, OSError, ValueError):
            fd = None
        if isinstance(fd, int):
            self.stdout, self.mode = fd, "text"

    def received(self, data: bytes, worker: int) -> bytes:
        """Bytes ``data`` a worker wrote to the pipe of its standard output (with the
        unfinished line left from before): its whole lines appended to :attr:`file`,
        or else each relayed (:func:`relay_log_line`); returns the unfinished line."""
        if self.file is not None:  # text lines: appended as they are
            end = data.rfind(b"\n") + 1
            if end:
                self._write(data[:end])
            return data[end:]
        *lines, rest = data.split(b"\n")
        for line in lines:
            relay_log_line(line, worker)
        return rest

    def ended(self, rest: bytes) -> None:
        """A worker exited with the unfinished line ``rest``: appended to :attr:`file`
        (a last line cut short is still a line of the log)."""
        if rest and self.file is not None:
            self._write(rest + b"\n")

    def _write(self, data: bytes) -> None:
        """Append whole text lines of a worker to :attr:`file`."""
        try:
            self.file.write(data)
            self.file.flush()
        except (OSError, ValueError):
            pass  # the log file closed at exit: nothing can be written anywhere


def relay_log_line(line: bytes, worker: int) -> None:
    """Log one line of a worker's JSON log (:mod:`crossbar.ops.jsonlog`) as this process's
    own event: the worker's message, namespace, level and fields, plus ``worker``
    (its index). The text log shows ``[namespace#level worker=N]``; the JSON log has
    ``"worker": N``. A line that is not a JSON object is logged as the message.

    A line of Twisted's legacy logging (``twisted.python.log.msg``: namespace
    ``log_legacy``, which names no source) keeps its system as twistd's text log shows
    it: ``[- worker=N]``, ``[HTTPChannel,0,127.0.0.1 worker=N]``, under the namespace
    ``crossbar.worker``."""
    text = line.decode("utf-8", "replace").rstrip("\r")
    if not text:
        return
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        doc = {"message": text}
    try:
        level = LogLevel.levelWithName(str(doc.pop("level", "info")))
    except InvalidLogLevelError:
        level = LogLevel.info
    namespace = str(doc.pop("namespace", "") or _WORKER)
    system = doc.pop("system", None)
    message = str(doc.pop("message", ""))
    # The worker's traceback (a string): into the message, so the text log shows it; never
    # as a "failure" field, which legacy observers take for a Failure object.
    failure = doc.pop("failure", None)
    if isinstance(failure, str) and failure and failure not in message:
        message = f"{message}\n{failure.rstrip()}"
    doc.pop("time", None)  # the time it is relayed, within milliseconds
    event = {k: v for k, v in doc.items() if isinstance(k, str) and not k.startswith("log_") and k != "format"}
    event["worker"] = worker
    logger = _relay_loggers.get(namespace)
    if logger is None:
        logger = Logger(namespace=_WORKER if namespace == _LEGACY else namespace)
        if len(_relay_loggers) < 256:
            _relay_loggers[namespace] = logger
    # The worker's message is already formatted: escaped, it is a format without fields,
    # shown as it is.
    if namespace == _LEGACY:
        event["log_system"] = f"{one_line(str(system or '-'))} worker={worker}"
    else:
        event["log_system"] = f"{namespace}#{level.name} worker={worker}"
    emit(logger, level, message.replace("{", "{{").replace("}", "}}"), event)


_WORKER = "crossbar.worker"
"""The namespace of a relayed line that names none of its own."""
_LEGACY = "log_legacy"
"""Twisted's namespace for events of its legacy ``log.msg`` (it names no source)."""

_relay_loggers: dict[str, Logger] = {}
"""A Logger per relayed namespace (at most 256 kept)."""
