"""The hosts drained one by one (docs/design.md §Operations: ``POST
/_crossbar/hosts/<name>/drain`` and ``/undrain``), as one process holds them.

A drain is the fleet's: the process that takes the request tells the others (a worker
its supervisor, which tells every worker and those it starts later; an instance the
others through Redis). Each process keeps the set in one :class:`HostDrains`, which
applies the same rules wherever it is: only configured hosts drain, a reload forgets
the hosts it removed, and a whole set read back replaces the one kept.
"""

from __future__ import annotations

from typing import Callable, Collection

__all__ = ["HostDrains"]


class HostDrains:
    """The drained hosts of one process.

    :param hosts: the configured host names now (the current config's).
    :ivar drained: the hosts being drained (read by choosing, status, metrics).
    """

    def __init__(self, hosts: Callable[[], Collection[str]]) -> None:
        self._hosts = hosts
        self.drained: set[str] = set()

    def set(self, host: str, draining: bool) -> bool:
        """Drain (or undrain) ``host``; False, changing nothing, for a host the config
        does not name."""
        if host not in self._hosts():
            return False
        if draining:
            self.drained.add(host)
        else:
            self.drained.discard(host)
        return True

    def changes(self, drains: dict[str, bool], whole: bool) -> dict[str, bool]:
        """What ``drains`` (host -> draining; with ``whole`` the full set, a configured
        host absent from it not draining) changes here, configured hosts only."""
        hosts = self._hosts()
        if whole:
            drains = {host: host in drains for host in hosts}
        return {host: draining for host, draining in drains.items()
                if host in hosts and draining != (host in self.drained)}

    def forget_removed(self) -> None:
        """After a reload: a host no longer configured is no longer draining."""
        self.drained.intersection_update(self._hosts())
