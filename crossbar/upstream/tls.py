"""TLS to ``https://`` hosts (docs/design.md §Access, §The proxy rule 7, §Configuration).

- :func:`client_creator` turns a host's ``tls`` settings into the
  ``IOpenSSLClientConnectionCreator`` Twisted's TLS wants: verified against ``tls.ca``
  (default: the system trust store, ``platformTrust()``), the host name or IP address
  checked, optional mutual TLS; ``verify: false`` gives
  :func:`unverified_creator`, which checks nothing.
- :class:`HostTLS` picks that creator per host address: it is the ``IPolicyForHTTPS``
  :class:`crossbar.upstream.pools.UpstreamEndpoints` takes.
- :class:`HandshakeFirstEndpoint` is TLS over a TCP endpoint whose ``connect()`` fires
  only once the handshake has succeeded, so a certificate or handshake failure is a
  *connect* failure (mark the host down, fail over: rule 7) that says what failed:
  :class:`TLSHandshakeError` with a short reason.
- :func:`tls_failure_reason` finds that reason in any failure (also inside Twisted's
  wrappers: ``ResponseNeverReceived``, ``RequestTransmissionFailed``,
  ``ResponseFailed``, anything with a ``reasons`` list), for ``last_err`` and log lines.
"""

from __future__ import annotations

import re
import weakref
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from OpenSSL import SSL
from service_identity import VerificationError
from service_identity.hazmat import DNS_ID, IPAddress_ID, ServiceID, verify_service_identity
from service_identity.pyopenssl import extract_patterns
from twisted.internet.abstract import isIPAddress, isIPv6Address
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import (
    IHandshakeListener,
    IOpenSSLClientConnectionCreator,
    IProtocol,
    IProtocolFactory,
    IReactorTime,
    IStreamClientEndpoint,
)
from twisted.internet.ssl import (
    Certificate,
    CertificateOptions,
    optionsForClientTLS,
    platformTrust,
    trustRootFromCertificates,
)
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.protocols.tls import TLSMemoryBIOFactory, TLSMemoryBIOProtocol
from twisted.python.failure import Failure
from twisted.web.iweb import IPolicyForHTTPS
from zope.interface import implementer

if TYPE_CHECKING:  # only types: importing the config (and YAML) is the daemon's business
    from crossbar.config import Config, HostTLSSettings

__all__ = [
    "HandshakeFirstEndpoint",
    "HostTLS",
    "TLSHandshakeError",
    "client_creator",
    "tls_failure_reason",
    "unverified_creator",
]


class TLSHandshakeError(Exception):
    """A TLS connection to a host failed before its handshake completed.

    :ivar reason: short and for operators: ``certificate expired``, ``unknown CA``,
        ``wrong name``, ``handshake timed out``, ``handshake failed: ...``.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# OpenSSL X509_V_ERR_* codes (x509_vfy.h) -> the short reason operators need.
_VERIFY_REASONS = {
    2: "unknown CA",  # UNABLE_TO_GET_ISSUER_CERT
    9: "certificate not yet valid",  # CERT_NOT_YET_VALID
    10: "certificate expired",  # CERT_HAS_EXPIRED
    18: "unknown CA",  # DEPTH_ZERO_SELF_SIGNED_CERT (self signed)
    19: "unknown CA",  # SELF_SIGNED_CERT_IN_CHAIN
    20: "unknown CA",  # UNABLE_TO_GET_ISSUER_CERT_LOCALLY
    21: "unknown CA",  # UNABLE_TO_VERIFY_LEAF_SIGNATURE
    23: "certificate revoked",  # CERT_REVOKED
    62: "wrong name",  # HOSTNAME_MISMATCH
    64: "wrong name",  # IP_ADDRESS_MISMATCH
}

# Certificate verification errors seen on a connection (the first is what failed),
# by its TLS protocol, for HandshakeFirstEndpoint to explain a failed handshake.
_verify_errors: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()


def _service_id(hostname: str) -> ServiceID:
    if isIPAddress(hostname) or isIPv6Address(hostname):
        return IPAddress_ID(hostname)
    return DNS_ID(hostname)


@implementer(IOpenSSLClientConnectionCreator)
class _VerifyingCreator:
    """``optionsForClientTLS``'s creator (trust root, client certificate, SNI), with
    the per-connection verify callback replaced by one that does the same checks
    (OpenSSL's chain verdict; the leaf against the host's name or IP address with
    service_identity, failing the connection with ``VerificationError`` like Twisted
    does) and also records OpenSSL's error code, so a failure can say *why*."""

    def __init__(self, hostname: str, inner: IOpenSSLClientConnectionCreator) -> None:
        self._hostname = hostname
        self._inner = inner

    def clientConnectionForTLS(self, tlsProtocol: TLSMemoryBIOProtocol) -> SSL.Connection:
        connection = self._inner.clientConnectionForTLS(tlsProtocol)
        errors: list[int] = []
        _verify_errors[tlsProtocol] = errors
        service_id = _service_id(self._hostname)
        protocol: list[TLSMemoryBIOProtocol] = [tlsProtocol]  # dropped after the leaf: no cycle

        def verify(conn: SSL.Connection, cert: Any, errno: int, depth: int, ok: int) -> bool:
            if not ok:
                errors.append(errno)
                return False
            if depth != 0:
                return True
            try:
                verify_service_identity(extract_patterns(cert), [service_id], [])
            except BaseException:  # fail closed, whatever went wrong
                errors.append(62)
                if protocol:
                    protocol[0].failVerification(Failure())
                return False
            finally:
                protocol.clear()
            return True

        connection.set_verify(SSL.VERIFY_PEER | SSL.VERIFY_FAIL_IF_NO_PEER_CERT, verify)
        return connection


@implementer(IOpenSSLClientConnectionCreator)
class _UnverifiedCreator:
    def __init__(self, hostname: str, options: CertificateOptions) -> None:
        self._hostname = hostname
        self._options = options

    def clientConnectionForTLS(self, tlsProtocol: TLSMemoryBIOProtocol) -> SSL.Connection:
        connection = SSL.Connection(self._options.getContext(), None)
        if not (isIPAddress(self._hostname) or isIPv6Address(self._hostname)):
            connection.set_tlsext_host_name(self._hostname.encode("idna"))
        return connection  # Twisted sets the client state and the app data


_PEM_CERTIFICATE = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.DOTALL)


def _client_certificate(tls: HostTLSSettings | None) -> dict[str, Any]:
    """``CertificateOptions`` keywords presenting the client certificate of ``tls``
    (cryptography objects: pyOpenSSL's own types are deprecated there)."""
    if tls is None or not tls.client_pem:
        return {}
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    return {
        "certificate": x509.load_pem_x509_certificate(tls.client_pem),
        "privateKey": load_pem_private_key(tls.client_pem, password=None),
    }


def unverified_creator(hostname: str, tls: HostTLSSettings | None = None) -> IOpenSSLClientConnectionCreator:
    """A creator that does NOT verify the host's certificate at all: no chain, no name,
    no expiry (``tls.verify: false``, the explicit escape hatch). The client
    certificate of ``tls`` is still presented (mutual TLS). SNI is sent for names.

    :param hostname: the host's name or IP address (no brackets), from its URL.
    """
    return _UnverifiedCreator(hostname, CertificateOptions(verify=False, **_client_certificate(tls)))


def client_creator(hostname: str, tls: HostTLSSettings | None) -> IOpenSSLClientConnectionCreator:
    """The TLS creator for one host (docs/design.md §Access).

    :param hostname: the host's name or IP address (no brackets), from its URL: what
        the certificate must name (and the SNI for a name).
    :param tls: the host's ``tls`` settings, or None for the defaults.
    :returns: verification against ``tls.ca`` (every certificate of the PEM bundle) or
        the system trust store, name checked, with the client certificate when
        configured; :func:`unverified_creator` when ``tls.verify`` is false.
    :raises OpenSSL.crypto.Error, ValueError: for PEM data that cannot be loaded (the
        config has already checked it parses).
    """
    if tls is not None and not tls.verify:
        return unverified_creator(hostname, tls)
    trust: Any = platformTrust()
    if tls is not None and tls.ca_pem:
        trust = trustRootFromCertificates([Certificate.loadPEM(pem) for pem in _PEM_CERTIFICATE.findall(tls.ca_pem)])
    options = optionsForClientTLS(hostname, trustRoot=trust, extraCertificateOptions=_client_certificate(tls))
    return _VerifyingCreator(hostname, options)


def _address(host: str, port: int) -> tuple[str, int]:
    host = host.lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port


@implementer(IPolicyForHTTPS)
class HostTLS:
    """The TLS policy per host address (``IPolicyForHTTPS``, what
    :class:`crossbar.upstream.pools.UpstreamEndpoints` takes as ``tls``).

    :param settings: ``(host, port)`` -> that address's ``tls`` settings (None: the
        defaults); an address not in it gets the defaults too (verified against the
        system store). Hosts are compared lower-case, IPv6 without brackets.

    Creators are built once per address and reused (each holds its OpenSSL context).
    """

    def __init__(self, settings: Mapping[tuple[str, int], HostTLSSettings | None]) -> None:
        self._settings = {_address(h, p): s for (h, p), s in settings.items()}
        self._creators: dict[tuple[str, int], IOpenSSLClientConnectionCreator] = {}

    @classmethod
    def from_config(cls, config: Config) -> HostTLS:
        """The policy for every ``https://`` host of ``config`` (the config guarantees
        one ``tls`` setting per address)."""
        settings: dict[tuple[str, int], HostTLSSettings | None] = {}
        for host in config.hosts.values():
            if host.url.scheme == "https":
                settings[(host.url.host, host.url.port)] = host.tls
        return cls(settings)

    def creatorForNetloc(self, hostname: bytes, port: int) -> IOpenSSLClientConnectionCreator:
        """The creator for a connection to ``hostname`` (bytes, as in the URL) and ``port``."""
        address = _address(hostname.decode("ascii"), port)
        creator = self._creators.get(address)
        if creator is None:
            creator = client_creator(address[0], self._settings.get(address))
            self._creators[address] = creator
        return creator


@implementer(IHandshakeListener)
class _Gate(ProtocolWrapper):
    """Sits between TLS and the application protocol; tells ``done`` how the handshake went."""

    def __init__(self, factory: WrappingFactory[Any], wrapped: IProtocol, done: Deferred[IProtocol]) -> None:
        super().__init__(factory, wrapped)
        self._done = done
        self.timed_out = False

    def handshakeCompleted(self) -> None:
        if not self._done.called:
            self._done.callback(self.wrappedProtocol)

    def connectionLost(self, reason: Failure) -> None:  # type: ignore[override]
        if not self._done.called:
            errors = _verify_errors.get(self.transport, [])
            self._done.errback(Failure(_handshake_error(reason, errors, self.timed_out)))
        super().connectionLost(reason)


def _handshake_error(reason: Failure, verify_errors: list[int], timed_out: bool) -> TLSHandshakeError:
    if timed_out:
        return TLSHandshakeError("handshake timed out")
    if isinstance(reason.value, VerificationError):
        return TLSHandshakeError("wrong name")
    if verify_errors:
        code = verify_errors[0]
        return TLSHandshakeError(_VERIFY_REASONS.get(code, f"certificate rejected (OpenSSL verify error {code})"))
    found = tls_failure_reason(reason)
    if found is not None:
        return TLSHandshakeError(found)
    text = reason.getErrorMessage().splitlines()[0] if reason.getErrorMessage() else type(reason.value).__name__
    return TLSHandshakeError(f"handshake failed: {text[:200]}")


class _GateFactory(WrappingFactory[_Gate]):
    protocol = _Gate
    noisy = False

    def __init__(self, wrapped: IProtocolFactory, done: Deferred[IProtocol]) -> None:
        super().__init__(wrapped)
        self._done = done
        self.gate: _Gate | None = None

    def buildProtocol(self, addr: Any) -> _Gate | None:  # type: ignore[override]  # None: refused
        inner = self.wrappedFactory.buildProtocol(addr)
        if inner is None:
            return None
        self.gate = _Gate(self, inner, self._done)
        return self.gate


@implementer(IStreamClientEndpoint)
class HandshakeFirstEndpoint:
    """TLS over ``wrapped`` whose ``connect()`` fires with the application protocol
    only after the TLS handshake completed (certificate verified).

    A failed handshake (a certificate refused, a name mismatch, a peer that is not a
    TLS server, or no handshake within ``timeout`` seconds) fails ``connect()`` with
    :class:`TLSHandshakeError` — a connect failure, like a refused connection. A
    refused client certificate under TLS 1.3 is only learnt after the handshake
    (the host's alert arrives with the first read): that one surfaces as a request
    failure; :func:`tls_failure_reason` recognises it there.

    :param creator: from :func:`client_creator` (or :meth:`HostTLS.creatorForNetloc`).
    :param wrapped: the TCP endpoint.
    :param clock: for the handshake timeout.
    :param timeout: seconds the handshake may take once TCP is connected.
    """

    def __init__(
        self, creator: IOpenSSLClientConnectionCreator, wrapped: IStreamClientEndpoint, clock: IReactorTime,
        timeout: float,
    ) -> None:
        self._creator = creator
        self._wrapped = wrapped
        self._clock = clock
        self._timeout = timeout

    def connect(self, protocolFactory: IProtocolFactory) -> Deferred[Any]:
        handshake: Deferred[IProtocol] = Deferred()
        gates = _GateFactory(protocolFactory, handshake)
        connecting = self._wrapped.connect(TLSMemoryBIOFactory(self._creator, True, gates))
        tls: list[Any] = []

        def cancel(d: Deferred[Any]) -> None:
            if tls:
                tls[0].abortConnection()
            else:
                connecting.cancel()

        result: Deferred[Any] = Deferred(cancel)

        def connected(tls_protocol: Any) -> None:
            tls.append(tls_protocol)
            gate = gates.gate

            def too_slow() -> None:
                if gate is not None:
                    gate.timed_out = True
                tls_protocol.abortConnection()

            timer = self._clock.callLater(self._timeout, too_slow)

            def settled(outcome: Any) -> None:
                if timer.active():
                    timer.cancel()
                if not result.called:
                    if isinstance(outcome, Failure):
                        result.errback(outcome)
                    else:
                        result.callback(outcome)
                elif not isinstance(outcome, Failure):
                    tls_protocol.abortConnection()  # cancelled just as the handshake ended

            handshake.addBoth(settled)

        def failed(f: Failure) -> None:
            if not result.called:
                result.errback(f)

        connecting.addCallbacks(connected, failed)
        return result


_ALERTS = (
    ("certificate required", "client certificate required by the host"),
    ("unknown ca", "client certificate refused by the host (unknown CA)"),
    ("bad certificate", "client certificate refused by the host"),
    ("certificate unknown", "client certificate refused by the host"),
    ("certificate expired", "client certificate refused by the host (expired)"),
)


def _ssl_error_reason(error: SSL.Error) -> str:
    reasons: list[str] = []
    for entry in error.args[0] if error.args and isinstance(error.args[0], list) else []:
        if isinstance(entry, tuple) and entry:
            reasons.append(str(entry[-1]))
    text = "; ".join(r for r in reasons if r) or (str(error) or "TLS error")
    low = text.lower()
    if "certificate verify failed" in low:
        return "certificate verify failed"
    for needle, short in _ALERTS:
        if needle in low:
            return short
    return f"handshake failed: {text[:200]}"


def _causes(value: Any) -> Iterable[Any]:
    if isinstance(value, Failure):
        yield value.value
        return
    for attribute in ("reasons", "failures"):
        inner = getattr(value, attribute, None)
        if isinstance(inner, (list, tuple)):
            yield from inner
    for attribute in ("__cause__", "__context__", "subFailure", "osError"):
        inner = getattr(value, attribute, None)
        if inner is not None:
            yield inner


def tls_failure_reason(failure: Failure | BaseException) -> str | None:
    """The short TLS reason inside ``failure``, or None when it is not a TLS failure.

    Looks through Twisted's wrappers (a ``Failure``'s value, the ``reasons`` lists of
    ``ResponseNeverReceived``, ``RequestTransmissionFailed``, ``ResponseFailed`` and
    any other exception carrying one, ``ConnectError``'s ``osError``, exception
    causes) for a
    :class:`TLSHandshakeError` (its reason), service_identity's ``VerificationError``
    (``wrong name``) or OpenSSL's ``SSL.Error`` (``certificate verify failed``, a
    refused client certificate, else ``handshake failed: <OpenSSL's reason>``).
    """
    seen: set[int] = set()
    stack: list[Any] = [failure]
    while stack:
        value = stack.pop(0)
        if id(value) in seen or len(seen) > 64:
            continue
        seen.add(id(value))
        if isinstance(value, TLSHandshakeError):
            return value.reason
        if isinstance(value, VerificationError):
            return "wrong name"
        if isinstance(value, SSL.Error):
            return _ssl_error_reason(value)
        stack.extend(_causes(value))
    return None
