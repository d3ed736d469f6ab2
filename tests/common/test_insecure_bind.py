"""A service serves plaintext gRPC beyond loopback only when told (--insecure-internal); with TLS the flag is
refused rather than ignored; the local launcher says it for the clusters it starts on such a host."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError
from services.common.server import ServerConfig, is_loopback
from services.common.tls import make_certs
from services.launcher import LocalCluster


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "pdserve-decode.example"])
def test_a_host_beyond_loopback_without_tls_is_refused_in_one_line(host):
    with pytest.raises(ConfigError, match=r"^--host / PDSERVE_HOST: .*not loopback and no TLS.*--insecure-internal"):
        ServerConfig(host=host)
    assert ServerConfig(host=host, insecure_internal=True).host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost"])
def test_loopback_serves_local_processes_without_the_flag(host):
    assert is_loopback(host) and ServerConfig(host=host).host == host


def test_tls_on_any_host_and_the_flag_with_tls_is_refused(tmp_path):
    make_certs(tmp_path, roles=("decode",))
    tls = dict(tls_cert=str(tmp_path / "decode.pem"), tls_key=str(tmp_path / "decode-key.pem"),
               tls_ca=str(tmp_path / "ca.pem"))
    assert ServerConfig(host="0.0.0.0", **tls).tls_enabled
    with pytest.raises(ConfigError, match=r"insecure-internal.*not both"):
        ServerConfig(host="0.0.0.0", insecure_internal=True, **tls)


def test_the_launcher_tells_services_on_a_wider_host_and_not_on_loopback(tmp_path):
    assert LocalCluster(host="0.0.0.0").tls_args("decode") == ["--insecure-internal"]
    assert LocalCluster(host="127.0.0.1").tls_args("decode") == []
    assert LocalCluster(host="0.0.0.0").tls_args("kvstore.mooncake_master") == []
