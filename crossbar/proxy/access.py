"""Client keys of a route (docs/design.md §Access): which key, if any, a request presents.

:func:`check_key` looks only at the request head's ``Authorization`` and ``X-Api-Key``
values, so a keyed route can refuse a request before any of its body is read.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Mapping, Sequence

from crossbar.config import ClientKey, Route
from crossbar.paths import needs_no_key

__all__ = ["authorize", "check_key", "key_named"]

_BEARER = b"bearer"


def authorize(keys: Mapping[str, ClientKey], authorization: bytes | None) -> str | None:
    """The name of the key in ``keys`` that ``authorization`` presents, or None.

    :param keys: a route's keys (:attr:`crossbar.config.Route.keys`), name -> key.
    :param authorization: the request's ``Authorization`` header value (bytes as
        received), or None when it has none.
    :returns: the key name for ``Bearer <secret>`` (the scheme in any case, whitespace
        around the scheme and the secret tolerated) when ``<secret>`` is one of the
        keys' secrets; None for no header, another scheme (``Basic``), an empty or
        wrong secret, or a route without keys.

    The SHA-256 of the presented secret is compared with :func:`hmac.compare_digest`
    against the digest of *every* key, with no early exit: neither which key matched
    nor how much of a secret matched, nor its length, shows in the time taken. (The
    config refuses one secret under two names, so at most one key matches.)
    """
    if authorization is None or not keys:
        return None
    parts = authorization.strip().split(None, 1)
    if len(parts) != 2 or parts[0].lower() != _BEARER:
        return None
    return key_named(keys, parts[1])


def key_named(keys: Mapping[str, ClientKey], secret: bytes) -> str | None:
    """The name of the key in ``keys`` whose secret is ``secret`` (bytes as received,
    whitespace around it tolerated), or None (an empty or wrong secret, no keys);
    compared as :func:`authorize` says, in constant time against every key."""
    if not keys:
        return None
    presented = hashlib.sha256(secret.strip()).digest()
    found: str | None = None
    for name, key in keys.items():
        if hmac.compare_digest(presented, key.digest) and found is None:
            found = name
    return found


def check_key(
    route: Route | None, method: bytes, authorization: Sequence[bytes] | None, has_body: bool = False,
    x_api_key: Sequence[bytes] | None = None, rest: bytes = b"",
) -> str | None:
    """Rule 2 of docs/design.md §The proxy, on the request head: the name of the key the
    request presents on a keyed route, "" where no key is needed (no such route, a
    route without keys, a CORS preflight: ``OPTIONS`` without a body), None when the
    request must be refused 401 (no valid key; more than one ``Authorization`` or
    ``X-Api-Key`` header; the two naming different keys).

    :param route: the configured route the request names (parsed once, in
        :class:`crossbar.proxy.head.RequestHead`), or None.
    :param method: the request method.
    :param authorization: every ``Authorization`` value of the request, or None.
    :param api_key: every ``X-Api-Key`` value (the bare secret: §Access), or None. A
        request may present its key in either header; a valid one in either admits it.
    :param has_body: the request announced a body (``Content-Length`` above 0, or
        chunked): a preflight never has one, so such an ``OPTIONS`` needs a key.
    :param x_api_key: every ``X-Api-Key`` value (``X-Api-Key: <secret>``, what
        Anthropic-style clients send; docs/design.md §Access), or None.
    :param rest: the path after the route segment: GET/HEAD ``/health`` and
        ``/v1/health`` need no key (:func:`crossbar.paths.needs_no_key`), as on
        llama-server; a valid key presented there is still named.
    """
    if route is None or not route.keys or (method == b"OPTIONS" and not has_body):
        return ""
    if needs_no_key(method, rest):
        named = check_key(route, method, authorization, has_body, x_api_key)
        return "" if named is None else named
    if (authorization is not None and len(authorization) != 1) or (x_api_key is not None and len(x_api_key) != 1):
        return None
    by_bearer = authorize(route.keys, authorization[0]) if authorization else None
    by_header = authorize(route.keys, b"Bearer " + x_api_key[0]) if x_api_key else None
    if by_bearer is not None and by_header is not None and by_bearer != by_header:
        return None
    return by_bearer if by_bearer is not None else by_header
