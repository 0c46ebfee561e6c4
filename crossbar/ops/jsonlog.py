"""JSON log lines for log shippers (docs/design.md §Shape: "JSON observers work").

Run ``twistd --logger crossbar.ops.jsonlog.observer -n crossbar --config crossbar.yaml``:
every log event becomes one JSON object on one line of standard output, e.g. the
per-request event of the proxy (docs/design.md §The proxy, rule 8)::

    {"time": "2026-11-29T21:17:03.123Z", "level": "info", "namespace": "crossbar.proxy",
     "message": "POST /r/v1/chat/completions -> gpu-a 200 5120B ttfb=81.2ms 2203.4ms",
     "route": "r", "host": "gpu-a", "method": "POST", "path": "/v1/chat/completions",
     "status": 200, "bytes": 5120, "ttfb_ms": 81.2, "ms": 2203.4, ...}

Keys: ``time`` (RFC 3339, UTC), ``level``, ``namespace``, ``message`` (the event
formatted as the text log shows it), ``system`` (for legacy events), ``failure`` (the
traceback, when the event carries one), then the event's own fields (any whose name
does not start with ``log_``); a value JSON cannot hold is written as its ``repr``.
Without ``--logger`` the usual readable text log is unchanged.

This is not :func:`twisted.logger.jsonFileLogObserver`: that one is made for
round-tripping events through :func:`~twisted.logger.eventFromJSON` (an ``\\x1e``
before each record, levels as ``{"name": ..., "__class_uuid__": ...}``, no formatted
message), which log shippers do not read well. It uses the same writer,
:class:`twisted.logger.FileLogObserver`.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from typing import IO, Any

from twisted.logger import FileLogObserver, ILogObserver, LogEvent, formatEvent

__all__ = ["event_as_line", "observer", "observer_to"]


_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False)  # made once (json.dumps with options makes one per call)
_PLAIN = frozenset({str, int, float, bool, type(None)})
_SKIPPED = frozenset({"format", "message", "isError"})
_ONE_FIELD = re.compile(r"\{(\w+)\}\Z")
_one_field: dict[str, str | None] = {}  # log_format -> its one field's name (or None), per format string
_second: list[Any] = [None, ""]  # the last whole second stamped, and its "YYYY-MM-DDTHH:MM:SS"


def _stamp(when: float) -> str:
    """``when`` (epoch seconds) as RFC 3339 UTC with milliseconds, as
    ``datetime.isoformat(timespec="milliseconds")`` writes it (microseconds rounded,
    then truncated), the date and time formatted once per second."""
    fraction, whole = math.modf(when)
    second, micros = int(whole), round(fraction * 1_000_000)
    if micros >= 1_000_000:
        second, micros = second + 1, micros - 1_000_000
    if second != _second[0]:
        _second[0], _second[1] = second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
    return f"{_second[1]}.{micros // 1000:03d}Z"


def _message(event: LogEvent) -> str:
    """:func:`~twisted.logger.formatEvent`, with a shortcut for the most common shape on
    the request path: a format that is one field (``"{line}"``) whose value is text."""
    fmt = event.get("log_format")
    if type(fmt) is str:
        name = _one_field.get(fmt, "")
        if name == "":
            match = _ONE_FIELD.match(fmt)
            name = match.group(1) if match is not None else None
            if len(_one_field) < 256:
                _one_field[fmt] = name
        if name is not None:
            value = event.get(name)
            if type(value) is str:
                return value
    return formatEvent(event)


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)


def event_as_line(event: LogEvent) -> str:
    """One log event as one line of JSON (ending in ``\\n``); never raises."""
    stamp = event.get("log_time")
    doc: dict[str, Any] = {}
    if isinstance(stamp, (int, float)):
        doc["time"] = _stamp(stamp)
    level = event.get("log_level")
    doc["level"] = getattr(level, "name", "info")
    doc["namespace"] = event.get("log_namespace", "")
    doc["message"] = _message(event)
    if "log_system" in event:
        doc["system"] = _jsonable(event["log_system"])
    failure = event.get("log_failure")
    if failure is not None:
        try:
            doc["failure"] = failure.getTraceback()
        except Exception:
            doc["failure"] = repr(failure)
    for key, value in event.items():
        if key[:4] != "log_" and key not in doc and key not in _SKIPPED:
            doc[key] = value if type(value) in _PLAIN else _jsonable(value)
    try:
        line = _ENCODER.encode(doc) + "\n"
        # A lone surrogate (text a host or client sent) cannot be written as UTF-8: as
        # the JSON escape it stands for, the line stays valid JSON and is not lost.
        return line if line.isascii() else line.encode("utf-8", "backslashreplace").decode("utf-8")
    except ValueError:  # NaN or infinity somewhere
        return json.dumps(_jsonable({k: repr(v) if isinstance(v, float) else v for k, v in doc.items()})) + "\n"


def observer_to(out: IO[Any]) -> ILogObserver:
    """An observer writing :func:`event_as_line` lines to ``out`` (flushed per event)."""
    return FileLogObserver(out, event_as_line)


def observer() -> ILogObserver:
    """The ``twistd --logger`` factory: JSON lines on standard output.

    Standard output is taken when twistd calls this, before it redirects ``sys.stdout``
    into the log.
    """
    return observer_to(sys.stdout)
