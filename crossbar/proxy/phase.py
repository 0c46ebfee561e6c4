"""Where one exchange is, and every move it may make (docs/design.md §The proxy).

:data:`NEXT` is the whole transition table of :class:`Phase`; an
:class:`~crossbar.proxy.exchange.Exchange` moves only through it, and each of its event
handlers says with :func:`acts_in` in which phases it acts (a late event -- a timer, an
answer after the client left -- is dropped there, not guarded in the handler).
"""

from __future__ import annotations

from enum import Enum
from functools import wraps
from typing import Any, Callable, Final, TypeVar, cast

__all__ = ["LIVE", "NEXT", "IllegalMove", "Phase", "Phased", "acts_in"]


class Phase(Enum):
    """Where an exchange is."""

    ROUTING = "routing"
    """Rules 1-4: route, path, body and model."""
    QUEUED = "queued"
    """Rule 5 / §Choosing a host rule 4: waiting in the route's queue for room."""
    FORWARDING = "forwarding"
    """Rules 5-7: a host is being connected to, or its response head awaited."""
    RELAYING = "relaying"
    """Rule 6: the answer's head went out; its body streams."""
    ENDED = "ended"
    """Answered, failed or abandoned; the record was written."""

    # Identity hashing in C (members are singletons): Enum's own ``__hash__`` is a Python
    # call, and every move looks the phase up in :data:`NEXT`.
    __hash__ = object.__hash__


NEXT: Final[dict[Phase, frozenset[Phase]]] = {
    Phase.ROUTING: frozenset({Phase.FORWARDING, Phase.ENDED}),
    Phase.FORWARDING: frozenset({Phase.FORWARDING, Phase.QUEUED, Phase.RELAYING, Phase.ENDED}),
    Phase.QUEUED: frozenset({Phase.FORWARDING, Phase.ENDED}),
    Phase.RELAYING: frozenset({Phase.ENDED}),
    Phase.ENDED: frozenset(),
}
"""Every move an exchange may make (a failover forwards again, and may queue)."""

LIVE: Final = (Phase.ROUTING, Phase.QUEUED, Phase.FORWARDING, Phase.RELAYING)
"""The phases before the end."""


class IllegalMove(RuntimeError):
    """A move :data:`NEXT` does not allow (a bug in crossbar: the exchange's
    ``on_bug`` answers 500 or cuts the client, as for any other)."""


class Phased:
    """An object that moves through :data:`NEXT`, starting at ``ROUTING``.

    :ivar phase: where it is.
    """

    def __init__(self) -> None:
        self.phase = Phase.ROUTING

    def _enter(self, phase: Phase) -> None:
        """Move to ``phase``.

        :raises IllegalMove: :data:`NEXT` does not allow it (as h11's and Twisted's
            state machines raise on an illegal move, rather than stay silently)."""
        if phase not in NEXT[self.phase]:
            raise IllegalMove(f"{type(self).__name__}: {self.phase.value} -> {phase.value}")
        self.phase = phase


_F = TypeVar("_F", bound=Callable[..., None])


def acts_in(*phases: Phase) -> Callable[[_F], _F]:
    """Decorate a method of an object with a ``phase``: it runs only while ``phase`` is
    one of ``phases``, and is a no-op otherwise."""
    def wrap(handler: _F) -> _F:
        @wraps(handler)
        def guarded(self: Any, *args: Any, **kwargs: Any) -> None:
            if self.phase in phases:
                handler(self, *args, **kwargs)
        return cast(_F, guarded)
    return wrap
