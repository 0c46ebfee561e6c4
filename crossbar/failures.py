"""One-line reasons for failed requests, for ``last_err`` and logs."""

from __future__ import annotations

from twisted.python.failure import Failure

__all__ = ["describe_failure"]


def describe_failure(failure: Failure, limit: int = 300) -> str:
    """A single-line reason for ``failure``, at most ``limit`` characters.

    Twisted's client wraps the real cause of ``ResponseNeverReceived`` and friends in
    a list of failures (``reasons``): the first one is described instead.
    """
    value = failure.value
    reasons = getattr(value, "reasons", None)
    if reasons:
        return describe_failure(reasons[0], limit)
    text = " ".join(str(value).split()) or type(value).__name__
    return text[:limit]
