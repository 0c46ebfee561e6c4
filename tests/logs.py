"""Capture ``twisted.logger`` events for one test.

:class:`LogCapture` keeps every event emitted while the test runs; its queries answer
the questions tests ask of the log: what went wrong (:meth:`LogCapture.errors`), the
proxy's per-request lines (:meth:`LogCapture.proxied`), and whether a secret leaked
(:meth:`LogCapture.assert_never_contains`).
"""

from __future__ import annotations

from typing import Any, cast

from twisted.logger import ILogObserver, LogLevel, formatEvent, globalLogPublisher
from twisted.trial.unittest import TestCase

__all__ = ["LogCapture"]


class LogCapture:
    """Every ``twisted.logger`` event emitted while installed (removed at cleanup).

    :ivar events: the events, in order.
    """

    def __init__(self, case: TestCase) -> None:
        self.events: list[dict[str, Any]] = []
        observer = cast(ILogObserver, self.events.append)
        globalLogPublisher.addObserver(observer)
        case.addCleanup(globalLogPublisher.removeObserver, observer)

    def errors(self) -> list[str]:
        """The text of every event that reports a failure or an unhandled error
        (``log_failure``, level error/critical, or 'Unhandled' in its text)."""
        out = []
        for event in self.events:
            text = formatEvent(event) or ""
            if (
                event.get("log_failure") is not None
                or event.get("log_level") in (LogLevel.error, LogLevel.critical)
                or "Unhandled" in text
            ):
                out.append(text or repr(event))
        return out

    def proxied(self) -> list[dict[str, Any]]:
        """The proxy's per-request log lines."""
        return [e for e in self.events
                if str(e.get("log_namespace", "")).startswith("crossbar.proxy") and "ttfb_ms" in e]

    def assert_never_contains(self, case: TestCase, secret: bytes) -> None:
        """No event, formatted or as its raw fields, contains ``secret``."""
        text = secret.decode("latin-1")
        for event in self.events:
            formatted = formatEvent(event) or ""
            case.assertNotIn(text, formatted)
            for key, value in event.items():
                if key in ("log_logger", "log_source", "log_observer"):
                    continue
                rendered = value if isinstance(value, (str, bytes)) else repr(value)
                needle: Any = secret if isinstance(rendered, bytes) else text
                case.assertNotIn(needle, rendered, f"secret in log field {key!r}")
