"""The dashboard's memory: the recent requests (docs/design.md §Operations, the
dashboard). Its token figures -- tokens/s, cached share, the 15-minute chart -- are not
kept here but read from the one store status reads too
(:class:`~crossbar.state.tokens.TokenLedger`).

On the request path this costs one append to a bounded ring
(:meth:`RecentRequests.observe`, a :class:`~crossbar.ops.record.RequestLog` observer):
nothing is formatted or parsed per request. Display entries are made only while someone
looks, from the newest records of the ring.

With workers, the view must be the same whichever worker answers: each worker writes
its own entries to a small file in the workers' state directory
(``dashboard-<row>.json``, replaced atomically), and the worker serving the dashboard
reads every worker's file and merges them. A worker writes its file only while someone
looks: the serving worker touches ``dashboard-watch`` in the same directory, and a
worker whose last look at that file is older than :data:`WATCH_TTL` seconds writes
nothing. A worker that restarts takes its row's file back (its entries survive).
"""

from __future__ import annotations

import glob
import json
import os
from collections import deque
from typing import Any, Callable, Iterable

from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger

from crossbar.ops.record import RequestRecord

__all__ = ["RECENT", "TICK", "WATCH_TTL", "RecentRequests", "entry", "token_figures"]

RECENT = 300
"""Entries kept per process (the page shows the newest of every process's)."""
TICK = 0.5
"""Seconds between the timer's runs (while watched, writes of the worker's file)."""
WATCH_TTL = 10.0
"""Seconds a look at the dashboard keeps the workers writing their files."""
_TEXT_MAX = 200  # characters of any text field shown (model ids, why, paths)

_log = Logger(namespace="crossbar.ops")


def _text(value: Any) -> str:
    return "" if value is None else str(value)[:_TEXT_MAX]


def token_figures(record: RequestRecord) -> dict[str, float | None] | None:
    """The token figures of ``record`` (docs/design.md §What the answers say): ``prompt``
    (processed), ``cached``, ``generated`` and ``tps`` (generation speed) from its
    :class:`~crossbar.ops.figures.Figures`; None for an answer without figures (cut
    short, or the host said none)."""
    figures = record.figures
    if figures is None:
        return None
    speed = figures.generation_speed
    return {"prompt": float(figures.prompt), "cached": float(figures.cached),
            "generated": float(figures.generated), "tps": None if speed is None else float(speed)}


def entry(at: float, record: RequestRecord) -> dict[str, Any]:
    """One recent request as the dashboard shows it: no body, no query string, no
    secret (the key's name only); texts cut to 200 characters. ``model`` is the model
    as the client named it (not the metrics' ``other``), ``resolved`` the id an alias
    (or the route's ``default_model``) made of it when that differs, else ""."""
    named, resolved = _text(record.named), _text(record.resolved)
    return {
        "t": round(at, 3),
        "route": _text(record.route),
        "host": _text(record.host),
        "key": _text(record.key),
        "model": named,
        "resolved": "" if resolved == named else resolved,
        "method": _text(record.method),
        "path": _text(record.path),
        "status": record.status,
        "ended": record.ended,
        "why": _text(record.why),
        "ttfb": None if record.ttfb is None else round(record.ttfb, 4),
        "queued": round(record.queued, 4),
        "duration": round(record.duration, 4),
        "tokens": token_figures(record),
    }


class RecentRequests:
    """Recent requests of this process, and (with workers) every worker's.

    :param now: POSIX seconds (``reactor.seconds``).
    :param directory: with workers, the workers' state directory; None for one process.
    :param row: this worker's row (names its file).
    """

    def __init__(self, now: Callable[[], float], directory: str | None = None, row: int = 0) -> None:
        self._now = now
        self._ring: deque[tuple[float, RequestRecord]] = deque(maxlen=RECENT)
        self._appended = 0
        self._made = 0
        self.entries: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self.directory = directory
        self.row = row
        self.made = 0
        """Display entries made so far (a count that only grows)."""
        self._dirty = True
        self._watch_checked = -1e18
        self._watched_until = -1e18
        self._touched = -1e18
        if directory is not None:
            self._load_own()

    # -- the request path: one append --------------------------------------------------

    def observe(self, record: RequestRecord) -> None:
        """A :class:`~crossbar.ops.record.RequestLog` observer: remember ``record``."""
        self._ring.append((self._now(), record))
        self._appended += 1

    # -- the timer -------------------------------------------------------------------

    def tick(self) -> None:
        """With workers, while someone looks, make the new records' entries and write
        this worker's file. Never raises."""
        try:
            if self.directory is not None and self._watched():
                self.make_entries()
                self._write_own()
        except Exception:
            _log.failure("dashboard entries not updated")

    def make_entries(self) -> None:
        """Display entries for the newest records not made yet (at most :data:`RECENT`)."""
        new = min(self._appended - self._made, len(self._ring), RECENT)
        self._made = self._appended
        if new:
            self._dirty = True
            self.made += new
            ring = self._ring
            self.entries.extend(entry(*ring[i]) for i in range(len(ring) - new, len(ring)))

    # -- the fleet's view -------------------------------------------------------------

    def fresh(self) -> Deferred[None]:
        """Fires when :meth:`view` is as fresh as it gets (at once here: the view is
        read from memory and files; with ``cluster.redis`` after a read of Redis).
        Never fails."""
        return succeed(None)

    def scope(self) -> dict[str, Any]:
        """Whose requests :meth:`view` shows, for the page: ``shared`` is ``instance``
        (this process's) or ``workers`` (every worker's of this crossbar); ``note``
        says why the view is narrower than it should be, or None."""
        return {"shared": "instance" if self.directory is None else "workers", "note": None}

    def view(self) -> list[dict[str, Any]]:
        """Every process's recent entries, newest first. With workers this also says that
        someone looks (the workers start writing their files within :data:`TICK`
        seconds)."""
        self.make_entries()
        if self.directory is None:
            return list(reversed(self.entries))
        self._touch_watch()
        self._write_own()
        entries: list[dict[str, Any]] = []
        for doc in self._read_all():
            entries.extend(e for e in doc.get("recent", ()) if isinstance(e, dict))
        entries.sort(key=lambda e: e.get("t", 0), reverse=True)
        return entries

    # -- the workers' files -------------------------------------------------------------

    def _path(self, row: int | str) -> str:
        assert self.directory is not None
        return os.path.join(self.directory, f"dashboard-{row}.json")

    def _watched(self) -> bool:
        now = self._now()
        if now - self._watch_checked >= 1.0:
            self._watch_checked = now
            try:
                self._watched_until = os.stat(os.path.join(self.directory or "", "dashboard-watch")).st_mtime \
                    + WATCH_TTL
            except OSError:
                self._watched_until = -1e18
        return now < self._watched_until

    def _touch_watch(self) -> None:
        now = self._now()
        if now - self._touched < 1.0:
            return
        self._touched = now
        path = os.path.join(self.directory or "", "dashboard-watch")
        try:
            with open(path, "a"):
                pass
            os.utime(path, (now, now))
        except OSError as e:
            _log.warn("dashboard: cannot mark the workers' view as watched: {error}", error=e.strerror or str(e))

    def _document(self) -> dict[str, Any]:
        return {"recent": list(self.entries)}

    def _write_own(self) -> None:
        if not self._dirty:
            return
        path = self._path(self.row)
        temporary = f"{path}.{os.getpid()}.new"
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self._document(), f, separators=(",", ":"))
            os.replace(temporary, path)
            self._dirty = False
        except OSError as e:
            _log.warn("dashboard: cannot write this worker's recent requests: {error}", error=e.strerror or str(e))

    def _read_all(self) -> Iterable[dict[str, Any]]:
        for path in sorted(glob.glob(os.path.join(glob.escape(self.directory or ""), "dashboard-*.json"))):
            try:
                with open(path, encoding="utf-8") as f:
                    doc = json.load(f)
            except (OSError, ValueError):
                continue  # a worker replacing it right now, or gone
            if isinstance(doc, dict):
                yield doc

    def _load_own(self) -> None:
        """A restarted worker takes back what its row's file held."""
        try:
            with open(self._path(self.row), encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError):
            return
        if not isinstance(doc, dict):
            return
        self.entries.extend(e for e in doc.get("recent", ()) if isinstance(e, dict))
