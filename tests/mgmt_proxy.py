"""Test support: a real HTTP(S) proxy in front of the real RabbitMQ management API.

It forwards every request (method, path, body, credentials) to the API and answers what the
API answered, except for paths ``fail`` picks: those get the status ``fail`` gives (a
management API that breaks part way, as a restarting node or a faulty load balancer does).
With ``tls`` (a certificate and its key, PEM files) it serves HTTPS, as a management API
behind a TLS terminator with a private CA's certificate does. Also :func:`private_ca`: a CA
and a server certificate it signed, made with ``cryptography``.
"""

from __future__ import annotations

import datetime as dt
import http.server
import ipaddress
import ssl
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import requests
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

Fail = Callable[[str], int | None]
"""A request path -> the status to answer instead of forwarding it (None: forward it)."""


@dataclass
class Proxy:
    url: str
    fail: Fail | None = None
    forwarded: int = 0


@contextmanager
def management_proxy(upstream: str, *, tls: tuple[Path, Path] | None = None) -> Iterator[Proxy]:
    """A proxy to ``upstream`` (the management API's base URL) on a free local port."""
    proxy = Proxy(url="")

    class Handler(http.server.BaseHTTPRequestHandler):
        def _forward(self) -> None:
            size = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(size) if size else None
            status = proxy.fail(self.path) if proxy.fail is not None else None
            if status is not None:
                self._answer(status, b'{"error":"injected"}', "application/json")
                return
            headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
            r = requests.request(
                self.command, upstream + self.path, data=body, headers=headers, timeout=30
            )
            proxy.forwarded += 1
            self._answer(r.status_code, r.content, r.headers.get("content-type", ""))

        def _answer(self, status: int, body: bytes, ctype: str) -> None:
            self.send_response(status)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_PUT = do_DELETE = do_POST = _forward

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    scheme = "http"
    if tls is not None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(tls[0]), str(tls[1]))
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
        scheme = "https"
    proxy.url = f"{scheme}://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="mgmt-proxy", daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def private_ca(folder: Path) -> tuple[Path, Path, Path]:
    """(CA certificate, server certificate, server key), PEM files in ``folder``: a CA of
    its own, and a certificate it signed for 127.0.0.1 and localhost."""
    now = dt.datetime.now(dt.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("diode test private CA"))
        .issuer_name(_name("diode test private CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("127.0.0.1"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    paths = (folder / "ca.pem", folder / "server.pem", folder / "server.key")
    paths[0].write_bytes(ca.public_bytes(pem))
    paths[1].write_bytes(cert.public_bytes(pem))
    paths[2].write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths
