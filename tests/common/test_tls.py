"""services.common.tls: mTLS on a real grpc.aio ServiceServer (who gets in, what role the server sees),
the certificates make_certs writes, and `pdserve health` as the probe under mTLS."""

from __future__ import annotations

import asyncio
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from services.common.config import ConfigError
from services.common.grpc_util import create_channel
from services.common.pb import common_pb2, common_pb2_grpc
from services.common.server import ServerConfig, ServiceServer
from services.common.tls import (
    DEFAULT_SERVER_NAME,
    ROLES,
    TLSConfig,
    make_certs,
    peer_may_write_kv,
    peer_role,
    role_of_common_name,
)


class RoleEcho(common_pb2_grpc.AdminServicer):
    """GetLoad records what the server learned about the caller: (peer_role, peer_may_write_kv)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str | None, bool]] = []

    async def GetLoad(self, request: common_pb2.GetLoadRequest,
                      context: grpc.aio.ServicerContext) -> common_pb2.LoadReport:
        self.seen.append((peer_role(context), peer_may_write_kv(context, tls_on=True)))
        return common_pb2.LoadReport(running=7)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("other-ca"), ca_name="not-pdserve-ca")


def tls_for(d: Path, role: str, ca: Path | None = None) -> TLSConfig:
    return TLSConfig(tls_cert=str(d / f"{role}.pem"), tls_key=str(d / f"{role}-key.pem"),
                     tls_ca=str((ca or d) / "ca.pem"))


@pytest.fixture
async def server(certs: Path) -> AsyncIterator[tuple[str, RoleEcho]]:
    cfg = ServerConfig(host="127.0.0.1", port=0, metrics_port=-1, grace_s=0.2, drain_timeout_s=0.5,
                       tls_cert=str(certs / "decode.pem"), tls_key=str(certs / "decode-key.pem"),
                       tls_ca=str(certs / "ca.pem"))
    srv = ServiceServer("test", cfg)
    echo = RoleEcho()
    srv.add_service(common_pb2_grpc.add_AdminServicer_to_server, echo)
    await srv.start()
    await srv.set_serving()
    try:
        yield srv.grpc_address, echo
    finally:
        await srv.shutdown(force=True)


async def get_load(channel: grpc.aio.Channel) -> grpc.StatusCode:
    async with channel:
        try:
            await common_pb2_grpc.AdminStub(channel).GetLoad(common_pb2.GetLoadRequest(), timeout=5)
        except grpc.aio.AioRpcError as e:
            return e.code()
    return grpc.StatusCode.OK


# --- who gets in ----------------------------------------------------------------------------------

async def test_plaintext_client_fails_the_handshake(server: tuple[str, RoleEcho]) -> None:
    address, echo = server
    assert await get_load(grpc.aio.insecure_channel(address)) == grpc.StatusCode.UNAVAILABLE
    assert echo.seen == []


async def test_tls_client_without_a_certificate_is_refused(server: tuple[str, RoleEcho], certs: Path) -> None:
    address, echo = server
    creds = grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes())
    channel = grpc.aio.secure_channel(address, creds, options=[("grpc.ssl_target_name_override", DEFAULT_SERVER_NAME)])
    assert await get_load(channel) == grpc.StatusCode.UNAVAILABLE
    assert echo.seen == []


async def test_certificate_from_another_ca_is_refused(server: tuple[str, RoleEcho], certs: Path,
                                                      other_ca: Path) -> None:
    address, echo = server
    # A prefill certificate signed by another CA, presented by a client that does trust the server.
    forged = tls_for(other_ca, "prefill", ca=certs)
    assert await get_load(create_channel(address, tls=forged)) == grpc.StatusCode.UNAVAILABLE
    # A client that trusts only the other CA does not accept the server either.
    assert await get_load(create_channel(address, tls=tls_for(other_ca, "prefill"))) == grpc.StatusCode.UNAVAILABLE
    assert echo.seen == []


@pytest.mark.parametrize(("role", "expected"), [("router", ("router", False)), ("prefill", ("prefill", True)),
                                                ("kvstore", ("kvstore", False)), ("client", (None, False))])
async def test_right_certificate_is_served_and_its_cn_is_the_role(server: tuple[str, RoleEcho], certs: Path,
                                                                  role: str, expected: tuple) -> None:
    address, echo = server
    assert await get_load(create_channel(address, tls=tls_for(certs, role))) == grpc.StatusCode.OK
    assert echo.seen == [expected]


# --- roles and configuration ------------------------------------------------------------------------

@pytest.mark.parametrize(("cn", "role"), [("prefill", "prefill"), ("prefill-0", "prefill"),
                                          ("prefill.pdserve", "prefill"), ("Router", "router"),
                                          ("decode", "decode"), ("kvstore-1", "kvstore"), ("client", None),
                                          ("", None), ("0prefill", None), ("prefiller", None)])
def test_role_of_common_name(cn: str, role: str | None) -> None:
    assert role_of_common_name(cn) == role


def test_without_tls_every_local_peer_may_write_kv() -> None:
    class NoAuth:
        def auth_context(self) -> dict:
            return {}

    assert peer_may_write_kv(NoAuth(), tls_on=False) is True  # type: ignore[arg-type]
    assert peer_may_write_kv(NoAuth(), tls_on=True) is False  # type: ignore[arg-type]


def test_make_certs_writes_private_keys_and_role_names(certs: Path) -> None:
    ca = x509.load_pem_x509_certificate((certs / "ca.pem").read_bytes())
    for role in (*ROLES, "client"):
        cert = x509.load_pem_x509_certificate((certs / f"{role}.pem").read_bytes())
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == role
        assert cert.issuer == ca.subject
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert DEFAULT_SERVER_NAME in sans.get_values_for_type(x509.DNSName)
        assert stat.S_IMODE((certs / f"{role}-key.pem").stat().st_mode) == 0o600
    assert stat.S_IMODE((certs / "ca-key.pem").stat().st_mode) == 0o600


def test_tls_config_needs_all_three_existing_files(certs: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--tls-cert"):
        TLSConfig(tls_cert=str(certs / "decode.pem"))
    with pytest.raises(ConfigError, match="no such file"):
        TLSConfig(tls_cert=str(tmp_path / "missing.pem"), tls_key=str(certs / "decode-key.pem"),
                  tls_ca=str(certs / "ca.pem"))
    assert not TLSConfig().tls_enabled
    assert tls_for(certs, "decode").tls_enabled


# --- pdserve health: the Kubernetes probe under mTLS --------------------------------------------------

async def _health(address: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "services.cli", "health", "--address",
                                                    address, "--timeout-s", "5", *flags],
                                   capture_output=True, text=True, timeout=60)


async def test_health_command_checks_over_mtls(server: tuple[str, RoleEcho], certs: Path) -> None:
    address, _ = server
    ok = await _health(address, "--tls-cert", str(certs / "decode.pem"), "--tls-key", str(certs / "decode-key.pem"),
                       "--tls-ca", str(certs / "ca.pem"))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip().endswith("SERVING")
    plain = await _health(address)
    assert plain.returncode == 1
    assert "UNAVAILABLE" in plain.stderr


def test_certs_command_writes_a_private_dir_and_keeps_an_existing_ca(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli import main

    out = tmp_path / "certs"
    assert main(["certs", "--out", str(out), "--hosts", "localhost,10.1.2.3"]) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    printed = capsys.readouterr().out
    for role in ROLES:
        assert f"secret generic pdserve-tls-{role} --from-file=tls.crt={out}/{role}.pem" in printed
    cert = x509.load_pem_x509_certificate((out / "prefill.pem").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["10.1.2.3"]
    ca = (out / "ca.pem").read_bytes()
    assert main(["certs", "--out", str(out)]) == 2  # would replace the CA
    assert (out / "ca.pem").read_bytes() == ca
    assert main(["certs", "--out", str(out), "--force"]) == 0
    assert (out / "ca.pem").read_bytes() != ca
