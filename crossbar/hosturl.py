"""One configured host URL, parsed once, for polls and for proxied requests alike
(docs/design.md §Configuration: a host is an absolute ``http://`` or ``https://`` URL, a
trailing slash trimmed; §The health table: polls are ``<url>/health`` and
``<url>/v1/models``; §The proxy, rule 6: a request goes to ``<url><rest of path>``).

:class:`HostURL` is the record; :meth:`HostURL.target` is the only way crossbar builds
the absolute URL bytes it hands to crossbar's HTTP/1.1 client (``request`` of
:class:`~crossbar.upstream.h1client.H1Agent`, or of the poller's
:class:`~crossbar.upstream.pools.PollAgent`), for polls and requests.
The configured text is kept byte for byte: no library re-encodes the path (hyperlink,
which treq uses, percent-encodes ``[ ] | " { } ^`` and refuses IPv6 literals), so a poll
reaches exactly the host and base path a request reaches.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["HostURL", "HostURLError", "host_url"]

_URL = re.compile(r"(?P<scheme>https?)://(?P<authority>[^/?#\s]+)(?P<path>/[^?#\s]*)?\Z")
_PRINTABLE_ASCII = re.compile(r"[\x21-\x7e]+\Z")  # what an HTTP request target may hold
_DEFAULT_PORTS = {"http": 80, "https": 443}


class HostURLError(ValueError):
    """A host URL crossbar cannot use; the message says why (one line, no key path:
    the caller, e.g. the config loader, adds file and key)."""


@dataclass(frozen=True)
class HostURL:
    """A host's base URL (docs/design.md §Configuration, ``hosts``).

    :ivar url: the URL as configured, surrounding blanks and trailing slashes trimmed
        (``str``, printable ASCII).
    :ivar scheme: ``"http"`` or ``"https"``.
    :ivar host: the host name or IP literal as written, IPv6 without brackets.
    :ivar port: the port (``int``), explicit or the scheme's default (80 or 443).
    :ivar netloc: the authority as written: ``host``, ``host:port``, ``[v6]:port``.
    :ivar path: the base path as written, without trailing slash (``""`` for none),
        e.g. ``"/llama"`` or ``"/ll%7Ema"``; never re-encoded.
    """

    url: str
    scheme: str
    host: str
    port: int
    netloc: str
    path: str

    @classmethod
    def parse(cls, url: str) -> HostURL:
        """Parse a configured host URL, e.g. ``http://[::1]:8080/llama/``.

        :raises HostURLError: not an absolute ``http``/``https`` URL, a query or
            fragment, non-printable or non-ASCII characters, credentials, a bad IPv6
            literal, a missing host name, or a port outside 1-65535.
        """
        text = url.strip()
        m = _URL.match(text)
        if m is None:
            raise HostURLError(f"must be an absolute http:// or https:// URL without query, fragment or spaces, not {text!r}")
        if not _PRINTABLE_ASCII.match(text):
            raise HostURLError(
                f"must be printable ASCII (percent-encode the path, IDNA-encode the host name), not {text!r}"
            )
        scheme, netloc = m.group("scheme"), m.group("authority")
        if "@" in netloc:
            raise HostURLError("must not carry credentials (user@host)")
        if netloc.startswith("["):
            end = netloc.find("]")
            if end < 0:
                raise HostURLError(f"bad IPv6 address in {text!r}")
            host, port_text = netloc[1:end], netloc[end + 1:]
            try:
                ipaddress.IPv6Address(host.replace("%25", "%", 1))  # RFC 6874 zone: %25
            except ValueError:
                raise HostURLError(f"bad IPv6 address in {text!r}") from None
        else:
            host, _, port_text = netloc.partition(":")
            port_text = ":" + port_text if port_text or netloc.endswith(":") else ""
            if not host:
                raise HostURLError(f"missing host name in {text!r}")
        port = _DEFAULT_PORTS[scheme]
        if port_text:
            digits = port_text[1:]
            if not port_text.startswith(":") or not digits.isdigit() or not 0 < int(digits) < 65536:
                raise HostURLError(f"bad port in {text!r}")
            port = int(digits)
        trimmed = text.rstrip("/")
        path = (m.group("path") or "").rstrip("/")
        return cls(url=trimmed, scheme=scheme, host=host, port=port, netloc=netloc, path=path)

    def target(self, rest_and_query: bytes) -> bytes:
        """The absolute URL bytes for an agent's ``request``: the configured URL followed by
        ``rest_and_query`` unchanged (``b""``, or starting with ``b"/"`` or ``b"?"``),
        e.g. ``target(b"/health")`` for a poll, ``target(b"/v1/chat/completions?x=1")``
        for a proxied request.

        :raises ValueError: ``rest_and_query`` starts otherwise (it would change the
            authority or the last path segment of the base URL).
        """
        if rest_and_query and rest_and_query[:1] not in (b"/", b"?"):
            raise ValueError(f"a target must start with '/' or '?', not {rest_and_query[:20]!r}")
        return self.url.encode("ascii") + rest_and_query


@lru_cache(maxsize=4096)
def host_url(url: str) -> HostURL:
    """:meth:`HostURL.parse`, remembered: polls and requests carry the configured
    ``str`` and parse it once per distinct URL (a frozen record is safe to share).

    :raises HostURLError: see :meth:`HostURL.parse` (errors are not remembered).
    """
    return HostURL.parse(url)
