"""A grpc.aio server on loopback for service tests (a real server on an ephemeral port)."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from services.common.tls import TLSConfig


async def loopback_server(add: Callable[[grpc.aio.Server], object], tls: TLSConfig | None = None,
                          **server_kw: object) -> tuple[grpc.aio.Server, str]:
    """A started server on 127.0.0.1 and a free port, with ``add(server)`` registering its servicers and
    mTLS when ``tls`` is given; returns (server, "127.0.0.1:PORT"). The caller stops it."""
    server = grpc.aio.server(**server_kw)  # type: ignore[arg-type]
    add(server)
    if tls is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", tls.server_credentials())
    await server.start()
    return server, f"127.0.0.1:{port}"
