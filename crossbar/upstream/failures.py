"""One-line reasons for failed requests, for ``last_err`` and logs."""

from __future__ import annotations

from twisted.python.failure import Failure

from crossbar.upstream.tls import tls_failure_reason

__all__ = ["describe_failure"]


def describe_failure(failure: Failure, limit: int = 300) -> str:
    """A single-line reason for ``failure``, at most ``limit`` characters.

    Twisted's client wraps the real cause of ``ResponseNeverReceived`` and friends in
    a list of failures (``reasons``): the first one is described instead. A TLS
    failure anywhere inside is described by its short reason
    (:func:`crossbar.upstream.tls.tls_failure_reason`: ``unknown CA``, ``client certificate
    required by the host``, ...; docs/design.md §Access), never OpenSSL's raw error list.
    """
    tls = tls_failure_reason(failure)
    if tls is not None:
        return tls[:limit]
    value = failure.value
    reasons = getattr(value, "reasons", None)
    if reasons:
        return describe_failure(reasons[0], limit)
    text = " ".join(str(value).split()) or type(value).__name__
    return text[:limit]
