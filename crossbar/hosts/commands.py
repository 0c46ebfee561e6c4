"""Load and unload commands to router-mode hosts (docs/design.md §Where models live, rules
4-6): ``POST <host>/models/load {"model": M}`` and ``POST <host>/models/unload {"model":
M}``, as llama-server's router mode takes them (it answers ``{"success": true}`` at once
and loads or unloads in the background; a load of a model already running is 400
``model is already running``, which counts as done).

:class:`HTTPModelCommands` sends them through crossbar's one HTTP client
(:class:`~crossbar.upstream.pools.UpstreamPools`), with the host's ``api_key``; the
caller bounds each by ``timeouts.first_byte``. Nothing else sends these paths: clients'
own ``/models/load`` stays on the forbidden list (docs/design.md §The proxy rule 3).
"""

from __future__ import annotations

import json
from io import BytesIO
from typing import Any, Protocol

from twisted.internet.defer import CancelledError, Deferred, ensureDeferred
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers
from twisted.web.client import FileBodyProducer
from twisted.web.iweb import IResponse

from crossbar.config import Host
from crossbar.hosts.poller import BodyTooLarge, read_capped
from crossbar.upstream.failures import describe_failure
from crossbar.upstream.pools import UpstreamPools

__all__ = ["ACTIONS", "FAILURES", "CommandFailed", "HTTPModelCommands", "ModelCommands", "http_failure"]

ACTIONS = ("load", "unload")

_MAX_ANSWER = 64 * 1024
"""Bytes of a command's answer read at most (it is a few bytes of JSON)."""


FAILURES = ("timeout", "http_4xx", "http_5xx", "http_other", "too_large", "connection", "error", "kept")
"""The classes of a failed command (the ``failure`` label of
``crossbar_model_command_failures_total``): no answer within ``timeouts.first_byte``, a
status other than 2xx by its class, an answer over :data:`_MAX_ANSWER` bytes, the
connection failed or was lost, anything else, and an unload the host answered but two
polls after still listed the model loaded (``kept``)."""


class CommandFailed(Exception):
    """A command was not done; ``reason`` is one line (``HTTP 404``, the connection
    error), ``kind`` one of :data:`FAILURES`."""

    def __init__(self, reason: str, kind: str = "error") -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind


def http_failure(code: int) -> CommandFailed:
    """The failure of a command the host answered with status ``code`` (not 2xx)."""
    kind = "http_4xx" if 400 <= code < 500 else "http_5xx" if 500 <= code < 600 else "http_other"
    return CommandFailed(f"HTTP {code}", kind)


class ModelCommands(Protocol):
    """Sends load and unload commands (:class:`HTTPModelCommands`, or a fake in tests)."""

    def send(self, host: Host, action: str, model: str) -> Deferred[None]:
        """Tell ``host`` to ``action`` (``load`` or ``unload``) model id ``model``;
        fires once the host accepted it (2xx), fails with :class:`CommandFailed`;
        cancelling it closes its connection and fails it with ``CancelledError``."""


class HTTPModelCommands:
    """The real commands, over ``pools`` (the proxy's connections).

    :param pools: crossbar's upstream connection pools.
    """

    def __init__(self, pools: UpstreamPools) -> None:
        self.pools = pools

    def send(self, host: Host, action: str, model: str) -> Deferred[None]:
        """``POST <host>/models/<action>`` with ``{"model": model}``; see :class:`ModelCommands`."""
        return ensureDeferred(self._send(host, action, model))

    async def _send(self, host: Host, action: str, model: str) -> None:
        if action not in ACTIONS:
            raise ValueError(f"unknown action {action!r}")
        headers = Headers({b"Content-Type": [b"application/json"]})
        if host.api_key is not None:
            headers.setRawHeaders(b"Authorization", [b"Bearer " + host.api_key.encode("ascii")])
        body = json.dumps({"model": model}).encode("utf-8")
        agent, _ = self.pools.agent()
        target = host.url.target(b"/models/" + action.encode("ascii"))
        try:
            response: IResponse = await agent.request(b"POST", target, headers, FileBodyProducer(BytesIO(body)))
            answer = await read_capped(response, _MAX_ANSWER)
        except Exception:
            failure = Failure()
            if failure.check(CommandFailed, CancelledError):
                raise  # cancelled: the caller's bound (timeouts.first_byte) or crossbar stopping
            if failure.check(BodyTooLarge):
                raise CommandFailed(describe_failure(failure), "too_large") from None
            raise CommandFailed(describe_failure(failure), "connection") from None
        if 200 <= response.code < 300:
            return
        if action == "load" and response.code == 400 and b"already running" in answer:
            return  # loaded or loading already: what was wanted
        raise http_failure(response.code)
