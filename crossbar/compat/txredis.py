"""Every place crossbar touches a private txredisapi name, fenced in one module.

crossbar's shared counts (``cluster.redis``) use txredisapi's pooled, reconnecting
connections with two changes its public API does not offer:

- :class:`Protocol` packs each command with hiredis (C) by overriding
  ``RedisProtocol._build_command``: txredisapi encodes every argument in Python (about
  26 calls per command, cluster.redis's CPU);
- :func:`connect` does what ``RedisFactory.startConnecting`` does, with txredisapi's
  ``_PoolSlot`` and ``_SlotFactory``, each connection kept by a reconnecting service
  that logs nothing per attempt (:class:`~crossbar.compat.twisted.QuietClientService`:
  while Redis is away the cluster says so once, not every second), TCP_NODELAY on each
  connection, and whoever asks told why a connection ended and when the first attempt
  failed (a refused first connection settles readiness at once).

They were checked against txredisapi 1.6 (:data:`CHECKED`; ``pyproject.toml`` bounds
it ``>=1.6,<1.7``). The start-up check runs once, at import: :data:`FALLBACK` is None
when the installed version is in that range and the private names are as expected;
otherwise it says why, :class:`Protocol` is txredisapi's own and :func:`connect` is
``factory.startConnecting`` (one log line per reconnection attempt; readiness waits for
its 2 s cap when Redis is not there). ``tests/test_compat_txredis.py`` names what moved.
"""

from __future__ import annotations

from typing import Any, Callable

import txredisapi
from twisted.python.failure import Failure

from crossbar.compat import distribution_check, within
from crossbar.compat.twisted import QuietClientService

try:  # txredisapi parses replies with hiredis (C) when it is installed, as it is by default
    import hiredis
except ImportError:  # pragma: no cover - the pure-Python parser and command builder of txredisapi
    hiredis = None  # type: ignore[assignment]

__all__ = ["CHECKED", "FALLBACK", "Protocol", "connect", "moved", "version_checked"]

CHECKED = ((1, 6), (1, 6))
"""The oldest and the newest txredisapi (major, minor) checked, both included."""


def version_checked(major: int, minor: int) -> bool:
    """Whether txredisapi ``major.minor`` is within :data:`CHECKED` (as numbers)."""
    return within(CHECKED, major, minor)


def moved() -> list[str]:
    """The private txredisapi names :class:`Protocol` and :func:`connect` rely on that
    are not as expected in the installed txredisapi; empty when all are."""
    found: list[str] = []
    slot = getattr(txredisapi, "_PoolSlot", None)
    if not isinstance(slot, type):
        found.append("txredisapi._PoolSlot (it is gone)")
    else:
        for name in ("_retryDelay", "_prepareConnection", "start"):
            if not callable(getattr(slot, name, None)):
                found.append(f"txredisapi._PoolSlot.{name} (it is gone)")
    if not isinstance(getattr(txredisapi, "_SlotFactory", None), type):
        found.append("txredisapi._SlotFactory (it is gone)")
    if not callable(getattr(txredisapi.RedisProtocol, "_build_command", None)):
        found.append("txredisapi.RedisProtocol._build_command (it is gone)")
    if not callable(getattr(txredisapi.RedisFactory, "startConnecting", None)):
        found.append("txredisapi.RedisFactory.startConnecting (it is gone)")
    return found



FALLBACK: str | None = distribution_check("txredisapi", CHECKED, moved)
"""None when :class:`Protocol` and :func:`connect` may reach into txredisapi; else why
they are txredisapi's own (the start-up check, run at import)."""


def _protocol() -> type:
    if hiredis is None or FALLBACK is not None:  # pragma: no cover - txredisapi's own builder
        return txredisapi.RedisProtocol

    class Protocol(txredisapi.RedisProtocol):  # type: ignore[misc]
        """txredisapi's protocol (with hiredis: replies parsed in C), each command packed
        by hiredis too."""

        def _build_command(self, *args: Any, **kwargs: Any) -> bytes:
            return bytes(hiredis.pack_command(args))

    return Protocol


Protocol: Any = _protocol()
"""txredisapi's ``RedisProtocol``, each command packed by hiredis (C) where it can be."""


def connect(factory: Any, endpoint: Any, on_lost: Callable[[Failure], None] | None = None,
            on_first_failure: Callable[[Failure], None] | None = None) -> None:
    """Open and keep ``factory.poolsize`` connections of ``factory`` (a txredisapi
    ``RedisFactory`` or ``SubscriberFactory``) to ``endpoint``, as
    ``factory.startConnecting`` does, quietly and with TCP_NODELAY; ``on_lost`` is told
    why each connection ended, ``on_first_failure`` when a slot's first attempt failed.
    Under :data:`FALLBACK`: ``factory.startConnecting(endpoint)``, neither told."""
    if FALLBACK is not None:
        factory.startConnecting(endpoint)
        return
    for _ in range(factory.poolsize):
        slot = txredisapi._PoolSlot(factory, endpoint, factory.reconnect)

        def prepare(protocol: Any, slot: Any = slot) -> Any:
            _no_delay(protocol)
            if on_lost is not None:
                lost = protocol.connectionLost

                def connection_lost(reason: Failure, lost: Any = lost) -> Any:
                    on_lost(reason)
                    return lost(reason)

                protocol.connectionLost = connection_lost
            return slot._prepareConnection(protocol)

        slot.service = QuietClientService(
            endpoint, txredisapi._SlotFactory(factory, slot), retryPolicy=slot._retryDelay,
            prepareConnection=prepare,
        )
        factory.slots.append(slot)
        slot.start()
        if on_first_failure is not None:
            slot.service.whenConnected(failAfterFailures=1).addErrback(on_first_failure)


def _no_delay(protocol: Any) -> None:
    """TCP_NODELAY on the connection under ``protocol`` (through a TLS layer): without
    it Nagle's algorithm holds a command written while the previous one is unacknowledged
    until Redis's delayed ACK, ~40 ms -- most of the 50 ms bound."""
    transport = getattr(protocol, "transport", None)
    for _ in range(4):
        if transport is None:
            return
        set_no_delay = getattr(transport, "setTcpNoDelay", None)
        if set_no_delay is not None:
            set_no_delay(True)
            return
        transport = getattr(transport, "transport", None)
