"""One request head, parsed once, and the rules decided on it (docs/design.md §The proxy,
rules 1-4; §Access).

A :class:`RequestHead` is built once, when the request head is complete
(:meth:`crossbar.proxy.web.CrossbarRequest.gotLength`), from the config current then:
the route, the rest of the path, the query, the method and the client key. The body's
chunks and what the peek found are added once the body is in
(:meth:`RequestHead.with_body`). The exchange, access and the early-answer records read
it; nothing parses the request target again.

Where each of rules 1-4 lives:

- on the head, before any body byte is read (:func:`check_on_head`): a ``Host``
  header that is missing, repeated or not visible ASCII, and an asterisk-form target
  (400); rule 2's keys (401, with :func:`crossbar.proxy.access.check_key`);
- rule 4's size limit (413), while the body arrives:
  :class:`crossbar.proxy.request.CappedRequest`, which also feeds the peek;
- once the body is in (:func:`check_path`): rule 1 (400 ``missing route``), rule 2's
  404 ``unknown route``, rule 3 (400 ``bad path``, 405, 403 ``forbidden path``, 404
  ``not found``; the pure path checks are :mod:`crossbar.proxy.routing` and
  :mod:`crossbar.paths`), and rule 10's model list;
- rule 4's model and §Model names: :func:`wanted_model` (the peek's, the query's for a
  GET or HEAD, else the route's ``default_model``; aliases resolved) and
  :func:`upstream_body` (the body a chosen host gets: an alias's target written in, or
  the model a router-mode host needs).

A keyed client's ``max_inflight`` (429, §Access) depends on the requests in flight: the
exchange checks it when it starts (:meth:`crossbar.proxy.exchange.Exchange.start`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

from crossbar.config import Config, Route
from crossbar.ops.record import NO_ROUTE
from crossbar.proxy.access import check_key
from crossbar.proxy.peek import NOTHING, Peeked, rewrite_model
from crossbar.proxy.request import NO_BODY_METHODS
from crossbar.paths import PathKind, classify_path
from crossbar.proxy.routing import (
    has_dot_segment, is_forwardable, query_model, replace_query_model, split_route, split_target,
)

__all__ = [
    "METHODS", "REFUSED_METHODS", "Refusal", "RequestHead", "check_on_head", "check_path", "upstream_body", "wanted_model",
]

METHODS = (b"GET", b"HEAD", b"POST", b"PUT", b"PATCH", b"DELETE", b"OPTIONS")
"""The methods crossbar serves, exact case; any other is refused 405 on the head
(docs/design.md §The proxy, rule 9): ``trace`` as well as ``TRACE``, ``CONNECT``, ``BREW``."""

_ALLOW = b", ".join(METHODS)

REFUSED_METHODS = frozenset({b"TRACE", b"CONNECT"})
"""Never forwarded (405): a TRACE echoed by a host would show the client the host's
``api_key`` crossbar added (docs/design.md §Access; RFC 9110 §9.3.8), and a CONNECT is not
a request for a path (§9.3.6)."""

_HOST_VALUE = re.compile(rb"\A[\x21-\x7e]*\Z")
"""A ``Host`` value: visible ASCII (RFC 9110 §7.2: a uri-host and port), empty allowed."""


@dataclass(frozen=True)
class Refusal:
    """An answer crossbar makes itself instead of forwarding: ``code`` and the JSON
    error ``message`` (docs/design.md §The proxy, rule 9), with extra ``headers``."""

    code: int
    message: str
    headers: tuple[tuple[bytes, bytes], ...] = ()


class RequestHead(NamedTuple):
    """One request's head, as parsed once (see the module docstring): an immutable
    record made two or three times per request (parsed, its key, its body), so a named
    tuple (~2k instructions to make; a frozen dataclass of these fields ~15k).

    :ivar method: the request method, as sent.
    :ivar path: the request path as received (route included), never the query.
    :ivar query: the query string with its leading ``?``, or b"": forwarded as it is,
        never logged or kept (docs/design.md §The proxy, rule 8).
    :ivar route_name: the first path segment (rule 1), or None when there is none.
    :ivar rest: the path after the route segment, starting with ``/`` (b"" with no route).
    :ivar route: the configured route named by ``route_name`` under ``config``, or None.
    :ivar config: the config current when the head was complete: the request is
        checked and served under it (§Access: one config per request).
    :ivar key: the name of the client key presented on a keyed route, else "".
    :ivar peeked: the peek of the body (rule 4), :data:`~crossbar.proxy.peek.NOTHING`
        until the body is in, and for GET and HEAD.
    :ivar chunks: the body as it arrived, in pieces; empty until it is in. The request's
        own list (never a copy): emptied in place when the request ends or its client
        leaves (:meth:`crossbar.proxy.request.CappedRequest.release_body`), so a failover
        copy is never what holds a body.
    """

    method: bytes
    path: bytes
    query: bytes
    route_name: str | None
    rest: bytes
    route: Route | None
    config: Config
    key: str = ""
    peeked: Peeked = NOTHING
    chunks: Sequence[bytes] = ()

    def __repr__(self) -> str:
        """Never the query (rule 8), the config or the body."""
        return (f"RequestHead(method={self.method!r}, path={self.path!r}, route_name={self.route_name!r}, "
                f"rest={self.rest!r}, key={self.key!r}, peeked={self.peeked!r})")

    @classmethod
    def parse(cls, config: Config, method: bytes, target: bytes) -> RequestHead:
        """The head of ``method target`` under ``config`` (its key not checked yet)."""
        path, query = split_target(target)
        split = split_route(path)
        route_name, rest = split if split is not None else (None, b"")
        route = None if route_name is None else config.routes.get(route_name)
        return cls(method, path, query, route_name, rest, route, config)

    @property
    def route_label(self) -> str:
        """The route a record names: the configured route, else :data:`NO_ROUTE`
        (label values come only from the config)."""
        return NO_ROUTE if self.route is None else self.route.name

    @property
    def body(self) -> Sequence[bytes] | None:
        """The body to forward: the chunks, or None for a GET or HEAD without one
        (a body a client sends with one is forwarded, never peeked; rule 6)."""
        if self.method in NO_BODY_METHODS and not self.chunks:
            return None
        return self.chunks

    # The copies below name every field (cheaper than ``_replace``); tests/test_head.py
    # checks that they keep all others.

    def with_key(self, key: str) -> RequestHead:
        """This head with the client key ``key`` found on it."""
        return RequestHead(self.method, self.path, self.query, self.route_name, self.rest, self.route,
                           self.config, key, self.peeked, self.chunks)

    def under(self, config: Config) -> RequestHead:
        """This head served under ``config`` (a reload while it waits): the route of the
        same name there, everything else kept."""
        route = None if self.route_name is None else config.routes.get(self.route_name)
        return RequestHead(self.method, self.path, self.query, self.route_name, self.rest, route,
                           config, self.key, self.peeked, self.chunks)

    def with_body(self, chunks: Sequence[bytes], peeked: Peeked) -> RequestHead:
        """This head with its body in: ``chunks`` and what the peek found in them."""
        return RequestHead(self.method, self.path, self.query, self.route_name, self.rest, self.route,
                           self.config, self.key, peeked, chunks)


def check_on_head(
    head: RequestHead, hosts: Sequence[bytes], version: bytes, authorization: Sequence[bytes] | None,
    has_body: bool, x_api_key: Sequence[bytes] | None = None,
) -> str | Refusal:
    """The rules decided on the request head, before any body byte is read, in this
    order: the method (rule 9: :data:`METHODS`, else 405 with ``Allow``), the ``Host``
    header (RFC 9112 §3.2: exactly one in HTTP/1.1, visible ASCII), an asterisk-form
    target (rule 1: no route), the key (rule 2, §Access: ``Authorization`` or ``X-Api-Key``).

    :param hosts: every ``Host`` value; :param version: the request line's version.
    :param authorization: every ``Authorization`` value, or None; :param x_api_key:
        every ``X-Api-Key`` value, or None.
    :param has_body: the request announced a body (a CORS preflight never has one).
    :returns: the name of the key presented ("" where none is needed), or the refusal.
    """
    if head.method not in METHODS:
        return Refusal(405, "method not allowed", ((b"Allow", _ALLOW),))
    if len(hosts) > 1 or (not hosts and version == b"HTTP/1.1") or any(
            _HOST_VALUE.match(h) is None for h in hosts):
        return Refusal(400, "bad host header")
    if head.path == b"*":
        return Refusal(400, "missing route")
    key = check_key(head.route, head.method, authorization, has_body=has_body, x_api_key=x_api_key, rest=head.rest)
    if key is None:
        return Refusal(401, "invalid api key", ((b"WWW-Authenticate", b"Bearer"),))
    return key


def check_path(head: RequestHead) -> Refusal | PathKind:
    """Rules 1-3 on a request whose body is in, in this order: a route segment (400
    ``missing route``), a configured route (404 ``unknown route``), a path that can be
    forwarded as it is with no dot segment (400 ``bad path``), a method crossbar
    forwards (405), a path not forbidden (403 ``forbidden path``) and one crossbar
    forwards or answers (404 ``not found``; :func:`crossbar.paths.classify_path`).

    :returns: the refusal, else :attr:`~crossbar.paths.PathKind.FORWARD` or
        :attr:`~crossbar.paths.PathKind.MODEL_LIST` (rule 10).
    """
    if head.route_name is None:
        return Refusal(400, "missing route")
    route = head.route
    if route is None:
        return Refusal(404, "unknown route")
    rest = head.rest
    if has_dot_segment(rest) or not is_forwardable(head.method, rest + head.query):
        return Refusal(400, "bad path")
    if head.method in REFUSED_METHODS:
        return Refusal(405, "method not allowed")
    kind = classify_path(head.method, rest, route.paths)
    if kind is PathKind.FORBIDDEN:
        return Refusal(403, "forbidden path")
    if kind is PathKind.NOT_FOUND:
        return Refusal(404, "not found")
    return kind


def wanted_model(head: RequestHead, route: Route) -> tuple[str | None, bytes]:
    """Rule 4 and §Model names for a request of ``route``: the model it is chosen for
    and the query it is forwarded with.

    The model is the body's (the peek's), else for a GET or HEAD the query's ``model``
    parameter, else the route's ``default_model``; an alias of the route is replaced by
    its target (:meth:`crossbar.config.Route.resolve`), in the query too (the body's
    is written in per host by :func:`upstream_body`).
    """
    query, named = head.query, head.peeked.model
    if named is None and head.method in NO_BODY_METHODS:
        named = query_model(query)
        if named is not None and route.resolve(named) != named:
            query = replace_query_model(query, route.resolve(named))
    wanted = named if named is not None else route.default_model
    return (None if wanted is None else route.resolve(wanted)), query


def upstream_body(head: RequestHead, model: str | None, router: Callable[[], bool]) -> Sequence[bytes] | None:
    """The body sent to a host chosen for ``model`` (§"Model names"): the client's chunks
    as they came, except

    - a top-level ``"model"`` string that names an alias (``model``, the target, differs
      from it): its value replaced by ``model``, for every host;
    - a host in router mode (``router()`` says so; it refuses a request naming no model) and a JSON object
      naming none (no top-level ``"model"``, or an empty string): ``"model": <model>``
      written as the object's first member (or the empty value replaced). A single-model
      host gets such a body unchanged.

    Only the bytes at the peek's :class:`~crossbar.proxy.peek.Spot` change
    (:func:`~crossbar.proxy.peek.rewrite_model`: at most two chunks copied); the upstream
    ``Content-Length`` is the new chunks' length (:class:`crossbar.proxy.attempt.BytesProducer`).
    A body needing neither costs a comparison or two, no copy (``router`` is asked only
    of a body that names no model).

    :param model: the model the request was chosen for (:func:`wanted_model`), or None.
    :param router: whether the chosen host is in router mode
        (:attr:`crossbar.hosts.health.HostStatus.router`).
    """
    peeked = head.peeked
    spot = peeked.spot
    named = peeked.model
    if spot is None or model is None or named == model or (named is None and not router()):
        return head.body
    return rewrite_model(head.chunks, spot, model).chunks
