"""Rule 7 as one decision (docs/design.md §The proxy, rule 7; §Choosing a host, rule 4).

:func:`decide` maps what happened to a request's upstream side -- an attempt's
:class:`~crossbar.proxy.attempt.FailureKind` before the answer's head, a relay's
:class:`~crossbar.proxy.relay.RelayEnd` after it, or no host left to choose
(:class:`~crossbar.hosts.balance.Verdict`) -- and the hosts already tried to
what the exchange does: fail over, answer an error, cut the client, finish, or nothing;
and whether the host is marked down. It does no I/O; the exchange carries it out.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Literal, Sequence

from crossbar.hosts.balance import Verdict
from crossbar.proxy.attempt import FailureKind
from crossbar.proxy.relay import RelayEnd

__all__ = ["Action", "Decision", "Event", "decide", "queue_refusal"]

Event = FailureKind | RelayEnd | Literal[Verdict.NO_HOST, Verdict.NO_MODEL]
"""What happened: an attempt's failure before the head (phase ``FORWARDING``), how the
relayed body ended (phase ``RELAYING``), or no host left to choose (``NO_HOST``), or
none that serves the model (``NO_MODEL``: every healthy host is in router mode and none
lists it)."""


class Action(Enum):
    """What the exchange does next."""

    FAIL_OVER = "fail over"
    """Free the host, count it as tried, choose again among the others (may wait)."""
    ANSWER = "answer"
    """Answer crossbar's JSON error :attr:`Decision.code` / :attr:`Decision.message`."""
    ABORT_CLIENT = "abort client"
    """Cut the client's connection: it sees a truncated answer, never a clean end."""
    FINISH = "finish"
    """The answer ended cleanly: finish it."""
    NOTHING = "nothing"
    """Stopped from our side (the client left, a drain): nothing more to do."""


@dataclass(frozen=True)
class Decision:
    """What to do about one :data:`Event`.

    :ivar action: the next step.
    :ivar mark_down: take the host out of rotation (it really failed).
    :ivar code: for :attr:`Action.ANSWER`, the status; :ivar message: its error text.
    :ivar host: for :attr:`Action.ANSWER`, the host named in the JSON error, or None.
    """

    action: Action
    mark_down: bool = False
    code: int = 0
    message: str = ""
    host: str | None = None


_FINISH = Decision(Action.FINISH)
_NOTHING = Decision(Action.NOTHING)
_CUT = Decision(Action.ABORT_CLIENT, mark_down=True)
_CUT_CLIENT = Decision(Action.ABORT_CLIENT)  # the client's fault: the host is fine


def decide(event: Event, host: str | None, tried: Sequence[str], alive: bool = False) -> Decision:
    """Rule 7: what to do about ``event`` on a request now at ``host`` (None before
    one was chosen) that has already failed over from the hosts ``tried``; ``alive``:
    the host showed another sign of life since this request was sent (a good poll, a
    byte of another answer).

    - no connection (``CONNECT``): mark down, fail over;
    - the host failed after the request was sent, before the head (``REQUEST``): mark
      down, 502 ``upstream failed`` naming it (no retry: it may have started the work);
    - no head within ``timeouts.first_byte``: 504 ``upstream timed out`` naming it;
      mark down only if not ``alive`` (a busy host is not dead);
    - the host died or went silent mid-answer: mark down, cut the client;
    - the client took no byte for ``timeouts.client_stall``: cut it, mark nothing;
    - a clean end: finish; stopped from our side: nothing;
    - no healthy host left: 502 naming the last host tried after a failover, else 503
      ``no healthy host``; no host serves the model: 404 ``model not found``
      (§Choosing a host rule 1; nothing is marked down by choosing).
    """
    if event is Verdict.NO_MODEL:
        return Decision(Action.ANSWER, code=404, message="model not found")
    if event is Verdict.NO_HOST:
        if tried:
            return Decision(Action.ANSWER, code=502, message="upstream failed", host=tried[-1])
        return Decision(Action.ANSWER, code=503, message="no healthy host")
    if event is FailureKind.CONNECT:
        return Decision(Action.FAIL_OVER, mark_down=True)
    if event is FailureKind.FIRST_BYTE_TIMEOUT:
        return Decision(Action.ANSWER, mark_down=not alive, code=504, message="upstream timed out", host=host)
    if event is FailureKind.REQUEST:
        return Decision(Action.ANSWER, mark_down=True, code=502, message="upstream failed", host=host)
    if event is RelayEnd.COMPLETE:
        return _FINISH
    if event is RelayEnd.STOPPED:
        return _NOTHING
    if event is RelayEnd.CLIENT_STALL:
        return _CUT_CLIENT
    return _CUT  # RelayEnd.MID_ANSWER, RelayEnd.IDLE_TIMEOUT


def queue_refusal(queue_max: int, preflight: bool, queued: int) -> str | None:
    """§Choosing a host, rule 4: why a request finding no room may not wait in its
    route's queue (a 503 at once), or None when it may. ``queue_max``: the route's
    ``queue.max`` (0: no queue); ``preflight``: a keyless request on a keyed route, which
    never takes a place from the route's clients; ``queued``: the requests waiting now."""
    if queue_max == 0 or preflight:
        return "all hosts busy"
    if queued >= queue_max:
        return "queue full"
    return None
