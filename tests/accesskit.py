"""Helpers for the access tests (docs/design.md §Access): crossbar from a real config FILE
(so ``${NAME}`` secrets, ``load_config``'s warnings and ``service.reload()`` work as in
production), loopback TLS hosts with ``trustme`` certificates, and a recorder of every
upstream request's headers.

:func:`start_file` writes the YAML to a file and runs crossbar on it (its ``listen``
replaced by a free loopback port, plain or TLS); :func:`serve_tls` serves a resource
over TLS; :func:`write_pem` writes PEM bytes to a file of the test.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from cryptography import x509
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from twisted.internet import reactor
from twisted.internet.endpoints import SSL4ServerEndpoint
from twisted.internet.interfaces import IListeningPort
from twisted.internet.ssl import Certificate, CertificateOptions
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource

import trustme

from crossbar.config import load_config
from crossbar.process.service import CrossbarService, make_service
from tests.harness import _QuietSite

__all__ = ["auth_headers", "serve_tls", "start_file", "write_pem"]


def write_pem(case: TestCase, name: str, data: bytes) -> str:
    """Write ``data`` to ``name`` in a directory of the test; returns its path."""
    directory = case.mktemp()
    os.makedirs(directory, exist_ok=True)
    path = os.path.abspath(os.path.join(directory, name))
    with open(path, "wb") as f:
        f.write(data)
    return path


async def start_file(
    case: TestCase, config_yaml: str, environ: Mapping[str, str] | None = None, listen: str | None = None,
) -> tuple[CrossbarService, str, str]:
    """Write ``config_yaml`` (without ``listen:``) to a file, load it with
    :func:`crossbar.config.load_config` (``environ`` supplies ``${NAME}``; it is also
    put into ``os.environ`` for the test, so ``service.reload()`` sees it) and run
    crossbar on it until the test ends.

    :param listen: a Twisted server endpoint string on port 0 (default plain TCP on
        127.0.0.1); an ``ssl:`` one makes the base URL ``https://localhost:PORT``.
    :returns: the service, crossbar's base URL and the config file's path.
    """
    for name, value in (environ or {}).items():
        old = os.environ.get(name)
        os.environ[name] = value
        case.addCleanup(_restore, name, old)
    listen = listen or "tcp:0:interface=127.0.0.1"
    text = f"listen: \"{listen}\"\n"
    if "drain:" not in config_yaml:
        text += "drain: {delay: 0.001, grace: 0.001}\n"
    text += config_yaml
    path = write_pem(case, "crossbar.yaml", text.encode("utf-8"))
    service = make_service(load_config(path))
    service.startService()
    case.addCleanup(service.stopService)
    port = (await service.web.when_listening()).getHost().port  # type: ignore[attr-defined]
    scheme = "https://localhost" if listen.startswith("ssl:") else "http://127.0.0.1"
    return service, f"{scheme}:{port}", path


def _restore(name: str, old: str | None) -> None:
    if old is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = old


async def serve_tls(
    case: TestCase, resource: Resource, leaf: trustme.LeafCert, client_ca: trustme.CA | None = None,
) -> int:
    """Serve ``resource`` over TLS on 127.0.0.1 with certificate ``leaf`` (requiring a
    client certificate from ``client_ca`` when given) until the test ends; returns the
    port."""
    options = CertificateOptions(
        privateKey=load_pem_private_key(leaf.private_key_pem.bytes(), None),
        certificate=x509.load_pem_x509_certificate(leaf.cert_chain_pems[0].bytes()),
        verify=client_ca is not None,
        requireCertificate=client_ca is not None,
        caCerts=[Certificate.loadPEM(client_ca.cert_pem.bytes()).original] if client_ca is not None else None,
    )
    port: IListeningPort = await SSL4ServerEndpoint(reactor, 0, options, interface="127.0.0.1").listen(
        _QuietSite(resource)
    )
    case.addCleanup(port.stopListening)
    return port.getHost().port  # type: ignore[attr-defined]


def auth_headers(seen: Any) -> list[bytes]:
    """Every ``Authorization`` value of one request a FakeLlama saw (``Seen``)."""
    return list(seen.headers.getRawHeaders(b"authorization") or [])
