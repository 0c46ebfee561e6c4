"""A log event handed to its logger's observer without ``Logger.emit`` (docs/decisions.md,
"The request's log line skips ``Logger.emit``")."""

from __future__ import annotations

import time
from typing import Any

from twisted.logger import Logger, LogLevel

__all__ = ["emit"]


def emit(logger: Logger, level: LogLevel, log_format: str, event: dict[str, Any]) -> None:
    """``logger.emit(level, log_format, **event)``: the same ``log_*`` keys
    :meth:`Logger.emit` sets (Twisted's documented event keys), to the same observer,
    without its per-call scan of every ``LogLevel`` constant and its copy of the fields
    (~35k instructions of a proxied request's 1.34M, bench/README.md). ``event`` (the
    fields) becomes the event itself; ``level`` must be a ``LogLevel`` constant."""
    event["log_logger"], event["log_level"], event["log_namespace"] = logger, level, logger.namespace
    event["log_source"], event["log_format"], event["log_time"] = logger.source, log_format, time.time()
    logger.observer(event)
