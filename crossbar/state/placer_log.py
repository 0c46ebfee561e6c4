"""What the Placer's commands say in the log (docs/design.md §Where models live, rules 5-7).

A command that keeps failing is retried at each poll of its host (rule 6) without a
warning per poll: :class:`CommandLog` warns at the first failure of a streak per (host,
action, model), then at the 10th, the 100th and every 1000th (with the count so far),
and says once at info when the command finally succeeds. A host that accepts a load
and never lists the model loading gets one warning once it has done so
:data:`UNSEEN_AFTER` times in a row. A ``keep_loaded`` model that no host of its route
lists gets one warning per (route, model), again only after it was listed meanwhile.
"""

from __future__ import annotations

from typing import Iterable

from twisted.logger import Logger

from crossbar.config import one_line
from crossbar.hosts.health import HostStatus

__all__ = ["CommandLog", "UNSEEN_AFTER", "logged_at"]

UNSEEN_AFTER = 3
"""Accepted loads in a row that no poll showed loaded or loading before the warning."""


def logged_at(n: int) -> bool:
    """Whether the ``n``-th failure in a row (1-based) of one command is logged: the
    1st, the 10th, the 100th and every 1000th."""
    return n in (1, 10, 100) or n % 1000 == 0


class CommandLog:
    """The streaks of the Placer's commands and the log lines they give.

    :ivar failures: (host, action, model) -> failures in a row of that command.
    :ivar unseen: (host, model) -> loads the host accepted in a row while no poll of
        its showed the model loaded or loading.
    :ivar unlisted: (route, model) of the ``keep_loaded`` models warned of as listed by
        no host of the route (rule 5).
    """

    _log = Logger(namespace="crossbar.placement")

    def __init__(self) -> None:
        self.failures: dict[tuple[str, str, str], int] = {}
        self.unseen: dict[tuple[str, str], int] = {}
        self.unlisted: set[tuple[str, str]] = set()

    def quiet(self, host: str, action: str, model: str) -> bool:
        """Whether sending this command is a retry of a streak already told of (a failed
        one, or a load accepted :data:`UNSEEN_AFTER` times and never seen): its
        ``host h: load m`` line is not logged again."""
        return bool(self.failures.get((host, action, model))) or (
            action == "load" and self.unseen.get((host, model), 0) >= UNSEEN_AFTER)

    def failed(self, host: str, action: str, model: str, reason: str, again: str = "again after its next poll") -> None:
        """The command failed (``reason``: one line; ``again``: when it is tried next): a
        warning at the streak's 1st, 10th, 100th and every 1000th failure."""
        key = (host, action, model)
        n = self.failures[key] = self.failures.get(key, 0) + 1
        if not logged_at(n):
            return
        streak = "" if n == 1 else f"; {n} failures in a row"
        self._log.warn("host {host}: {action} {model} failed: {reason} ({again}{streak})",
                       host=host, action=action, model=one_line(model), reason=one_line(reason), again=again,
                       streak=streak)

    def accepted(self, host: str, action: str, model: str) -> None:
        """The host accepted the command: a streak of failures ends (one info line); a
        load counts towards :data:`UNSEEN_AFTER` until a poll shows the model."""
        n = self.failures.pop((host, action, model), 0)
        if n:
            self._log.info("host {host}: {action} {model} done after {n} failures", host=host, action=action,
                           model=one_line(model), n=n)
        if action != "load":
            return
        seen = self.unseen[(host, model)] = self.unseen.get((host, model), 0) + 1
        if seen == UNSEEN_AFTER:
            self._log.warn("host {host} accepted load {model} {n} times but never listed it loading",
                           host=host, model=one_line(model), n=seen)

    def polled(self, host: str, status: HostStatus) -> None:
        """A good poll of ``host`` listed ``status``: the loads it shows loaded or loading
        end their streaks, and so do the unloads it shows done (the goal is reached,
        whoever reached it)."""
        held = (*status.loaded, *status.loading)
        for seen in [k for k in self.unseen if k[0] == host and k[1] in held]:
            del self.unseen[seen]
        for done in [k for k in self.failures if k[0] == host and (k[2] in held) == (k[1] == "load")]:
            del self.failures[done]

    def keep_unlisted(self, route: str, models: Iterable[str], known: Iterable[str]) -> None:
        """Rule 5: ``models`` of ``route``'s ``keep_loaded`` (of ``known``, all of them)
        are listed by no host of the route: one warning each, again only after it was
        listed meanwhile."""
        missing = set(models)
        for model in known:
            if model not in missing:
                self.unlisted.discard((route, model))
            elif (route, model) not in self.unlisted:
                self.unlisted.add((route, model))
                self._log.warn("route {route}: keep_loaded model {model} is listed by no host of the route",
                               route=route, model=one_line(model))

    def forget(self, hosts: Iterable[str]) -> None:
        """Keep only the streaks of ``hosts`` (a reload removed the others)."""
        keep = set(hosts)
        self.failures = {k: n for k, n in self.failures.items() if k[0] in keep}
        self.unseen = {k: n for k, n in self.unseen.items() if k[0] in keep}

