"""What the fair order reads about a route's client keys, from the running state
(docs/design.md §Access, "Fair shares"; §Workers; §Several crossbars).

:class:`RuntimeStanding` is the :class:`~crossbar.state.queue.Standing` of a
:class:`~crossbar.state.runtime.Runtime`: each key's ``priority`` and ``share`` under
the current config, its requests in flight or waiting as the runtime counts them for
``max_inflight`` (fleet-wide with workers and with ``cluster.redis``), and the tokens
each key spent in the last minute as its limits count them.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

from crossbar.config import Config
from crossbar.state.limits import KeyLimiter

__all__ = ["KeyCounts", "RuntimeStanding"]


class KeyCounts(Protocol):
    """What the standing reads of the running state (a
    :class:`~crossbar.state.runtime.Runtime` is one)."""

    @property
    def config(self) -> Config:
        """The current config."""

    @property
    def key_inflight(self) -> Counter[tuple[str, str]]:
        """This process's requests in flight or waiting per (route, key)."""

    @property
    def limits(self) -> KeyLimiter:
        """The keys' limits (what each key spent)."""

    def key_requests(self, route: str, key: str) -> int:
        """``key``'s requests in flight or waiting, fleet-wide."""


class RuntimeStanding:
    """:class:`~crossbar.state.queue.Standing` read from ``runtime``."""

    def __init__(self, runtime: KeyCounts) -> None:
        self.runtime = runtime

    def settings(self, route: str, key: str) -> tuple[int, float]:
        """(``priority``, ``share``) of ``key`` under the current config; (0, 1.0) for
        none or a key a reload removed."""
        configured = self.runtime.config.routes.get(route)
        settings = configured.keys.get(key) if configured is not None else None
        return (0, 1.0) if settings is None else (settings.priority, settings.share)

    def requests(self, route: str, key: str) -> int:
        """``key``'s requests in flight or waiting: fleet-wide for a configured key
        (:meth:`Runtime.key_requests <crossbar.state.runtime.Runtime.key_requests>`),
        this process's for one a reload removed."""
        runtime = self.runtime
        configured = runtime.config.routes.get(route)
        if not key or configured is None or key not in configured.keys:
            return runtime.key_inflight[(route, key)] if key else 0
        return runtime.key_requests(route, key)

    def spent(self, route: str, key: str) -> int:
        """The tokens ``key`` spent in the last minute on ``route`` (this process's, or
        with workers the box's)."""
        limits = self.runtime.limits
        return limits.counts.spent(route, key, limits.now()).tokens_minute if key else 0
