"""A worker's token history on disk, so that a restarted worker shows the box's last
15 minutes like its siblings (docs/design.md §Workers: "the same totals whichever worker
answers"; §Operations: the dashboard's chart).

Every worker samples the box's token totals at each bucket start
(:class:`~crossbar.state.tokens.TokenLedger`); it also appends each sample, one JSON line
``{"start": <POSIX s>, "totals": {cell: tokens}}``, to ``tokens-<row>.jsonl`` in the
workers' state directory, and rewrites the file with the samples still needed once it
holds twice as many lines. A worker that starts in a row takes the samples back
(:meth:`TokenHistory.load`): they are the box's totals, which never go down (the
supervisor keeps a dead worker's share of every counter), so its next sample carries on
from them. Nothing on the request path touches the file.
"""

from __future__ import annotations

import json
import os
from typing import Any

from twisted.logger import Logger

from crossbar.state.token_window import BUCKET, KEEP

__all__ = ["TokenHistory"]

_log = Logger(namespace="crossbar.ops")

_NEEDED = KEEP // BUCKET + 3
"""Samples the chart and the last minute can use."""


class TokenHistory:
    """The samples of one worker's row (see the module doc).

    :param path: the file (``tokens-<row>.jsonl`` in the workers' state directory).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._lines = 0
        self._warned = False

    @classmethod
    def of_row(cls, shared: str, row: int) -> TokenHistory:
        """The history of ``row`` beside the workers' shared counts file ``shared``."""
        return cls(os.path.join(os.path.dirname(shared), f"tokens-{row}.jsonl"))

    def load(self, oldest: float) -> dict[int, dict[str, int]]:
        """The samples the file holds from bucket start ``oldest`` on, oldest first
        (empty when there is no file or nothing readable in it)."""
        samples: dict[int, dict[str, int]] = {}
        try:
            with open(self.path, encoding="utf-8") as f:
                for line in f:
                    doc = _parsed(line)
                    if doc is not None and doc[0] >= oldest:
                        samples[doc[0]] = doc[1]
        except OSError:
            return {}
        self._lines = len(samples)
        return dict(sorted(samples.items()))

    def append(self, start: int, totals: dict[str, int], samples: dict[int, dict[str, int]]) -> None:
        """Add the sample of bucket ``start``; with too many lines, rewrite the file
        from ``samples`` (all the ledger keeps). Never raises (logged once)."""
        try:
            if self._lines >= 2 * _NEEDED:
                temporary = f"{self.path}.{os.getpid()}.new"
                with open(temporary, "w", encoding="utf-8") as f:
                    f.writelines(_line(s, t) for s, t in samples.items())
                os.replace(temporary, self.path)
                self._lines = len(samples)
            else:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(_line(start, totals))
                self._lines += 1
        except OSError as e:
            if not self._warned:
                self._warned = True
                _log.warn("token history not written to {path}: {error}", path=self.path, error=e.strerror or str(e))


def _line(start: int, totals: dict[str, int]) -> str:
    return json.dumps({"start": start, "totals": totals}, separators=(",", ":")) + "\n"


def _parsed(line: str) -> tuple[int, dict[str, int]] | None:
    try:
        doc: Any = json.loads(line)
        start, totals = int(doc["start"]), doc["totals"]
        return start, {str(k): int(v) for k, v in totals.items()}
    except (ValueError, TypeError, KeyError, AttributeError):
        return None  # a line cut by a crash
