"""Mutual TLS between pdserve services, and the peer roles it proves.

Every service gets the same three files: its own certificate and key, and the CA that signed every
service's certificate. With them set, a server requires a client certificate from that CA (no
certificate, or one from another CA, fails the handshake), and every client channel presents its
own certificate and checks the server's. Without them, services bind loopback by default and trust
whatever can reach them (docs/SECURITY.md says exactly what that means).

A certificate's role is the first label of its Subject Common Name: ``prefill``, ``decode``,
``router`` or ``kvstore`` (``prefill``, ``prefill.pdserve`` and ``prefill-0`` all name a prefill).
Servers use it to decide who may write KV: only a peer whose certificate says ``prefill`` may push
pages into a decode's reservation or put pages into the kvstore.

Every certificate carries the DNS name :data:`DEFAULT_SERVER_NAME` besides its real host names, and
client channels verify servers against it (``grpc.ssl_target_name_override``), so instances found by
IP address (Kubernetes headless Services) verify like any other. ``pdserve certs`` makes a CA and one
certificate per role for local clusters and tests.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.common.config import opt, require

DEFAULT_SERVER_NAME = "pdserve.internal"
ROLES = ("router", "prefill", "decode", "kvstore")
_ROLE_RE = re.compile(r"^([a-z]+)")


@dataclass
class TLSConfig:
    """Mutual TLS for the gRPC server and every client channel of a service (all three, or none)."""

    tls_cert: str = opt("", "PEM certificate of this service (mTLS); empty with --tls-key/--tls-ca: no TLS.")
    tls_key: str = opt("", "PEM private key of --tls-cert.")
    tls_ca: str = opt("", "PEM CA bundle that signed every pdserve service's certificate; peers must present "
                          "a certificate from it.")
    tls_server_name: str = opt(DEFAULT_SERVER_NAME, "Name client channels verify in servers' certificates "
                                                    "(a SAN every service certificate carries).")

    def __post_init__(self) -> None:
        given = [bool(self.tls_cert), bool(self.tls_key), bool(self.tls_ca)]
        require(all(given) or not any(given), self, "tls_cert",
                "--tls-cert, --tls-key and --tls-ca go together (mTLS needs all three)")
        for name in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, name)
            require(not path or os.path.isfile(path), self, name, f"no such file: {path}")

    @property
    def tls_enabled(self) -> bool:
        return bool(self.tls_cert)

    def _read(self) -> tuple[bytes, bytes, bytes]:
        return (Path(self.tls_cert).read_bytes(), Path(self.tls_key).read_bytes(), Path(self.tls_ca).read_bytes())

    def server_credentials(self) -> grpc.ServerCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def role_of_common_name(cn: str) -> str | None:
    m = _ROLE_RE.match(cn.strip().lower())
    return m.group(1) if m and m.group(1) in ROLES else None


def peer_role(context: grpc.aio.ServicerContext) -> str | None:
    """The role proved by the peer's client certificate, or None (no TLS, or a certificate naming none)."""
    auth = context.auth_context() or {}
    for cn in auth.get("x509_common_name", []):
        role = role_of_common_name(cn.decode() if isinstance(cn, bytes) else cn)
        if role is not None:
            return role
    return None


def peer_identity(context: grpc.aio.ServicerContext) -> str:
    """Who a quota charges: the certificate's Common Name under mTLS, else the peer's IP address (every
    connection of one host is one identity: opening more connections buys no more quota)."""
    auth = context.auth_context() or {}
    for cn in auth.get("x509_common_name", []):
        return "cn:" + (cn.decode() if isinstance(cn, bytes) else cn)
    peer = context.peer() or ""  # "ipv4:127.0.0.1:5555", "ipv6:[::1]:5555", "unix:..."
    kind, _, rest = peer.partition(":")
    host = rest.rsplit(":", 1)[0] if kind in ("ipv4", "ipv6") else rest
    return f"{kind}:{host}"


def peer_may_write_kv(context: grpc.aio.ServicerContext, tls_on: bool) -> bool:
    """Whether this peer may write KV pages into a shared cache: any local peer without mTLS (loopback
    trust, see docs/SECURITY.md), only a certificate with role ``prefill`` with it."""
    return not tls_on or peer_role(context) == "prefill"


# --- certificates for local clusters and tests ------------------------------------------------------


def make_certs(out_dir: str | Path, *, roles: tuple[str, ...] = (*ROLES, "client"), days: int = 365,
               hosts: tuple[str, ...] = ("localhost", "127.0.0.1"), ca_name: str = "pdserve-ca") -> Path:
    """Write ca.pem / ca-key.pem and <role>.pem / <role>-key.pem for each role into ``out_dir``.

    Every certificate is valid for serving and as a client, with SANs ``hosts`` plus
    :data:`DEFAULT_SERVER_NAME`. Keys are written mode 0600."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
        data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_name)])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_subject).issuer_name(ca_subject)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False,
                                            encipher_only=False, decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))
    (out / "ca.pem").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    write_key(out / "ca-key.pem", ca_key)

    sans: list[x509.GeneralName] = [x509.DNSName(DEFAULT_SERVER_NAME)]
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    for role in roles:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, role)]))
                .issuer_name(ca_subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=days))
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        (out / f"{role}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        write_key(out / f"{role}-key.pem", key)
    return out
