"""The Python clients over TLS (the server's ``tls-port``): handshake, a large payload in both
directions (the sync client cannot use sendmsg on a TLS socket), a lease, the async client."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest

from kvstrata.clients import AsyncClient, Client
from tests.conftest import free_port
from tests.test_server_core import _self_signed

NS = "tls@u8"


@pytest.fixture
def tls_server(make_server, tmp_path: Path):
    cert, key = _self_signed(tmp_path)
    srv = make_server(tls_port=free_port(), tls_cert_file=cert, tls_key_file=key)
    return srv.server.tls_port, ssl.create_default_context(cafile=str(cert))


def test_sync_client_over_tls(tls_server) -> None:
    port, ctx = tls_server
    payload = bytes(range(256)) * 8192  # 2 MiB: several TLS records each way
    with Client(port=port, tls=ctx, tls_server_name="localhost") as kv:
        assert kv.ping()
        assert kv.put(NS, b"h1", None, payload)
        assert kv.get(NS, b"h1") == payload
        out = bytearray(len(payload))
        assert kv.mget(NS, [b"h1", b"nope"], outs=[out, bytearray(8)])[1] is None
        assert out == payload
        with kv.lease(NS, [b"h1"], tier="dram") as lease:
            assert bytes(lease.views()[0]) == payload


def test_sync_client_checks_the_certificate(tls_server) -> None:
    port, _ = tls_server
    with pytest.raises(ssl.SSLError):
        Client(port=port, tls=ssl.create_default_context(), tls_server_name="localhost")


def test_async_client_over_tls(tls_server) -> None:
    port, ctx = tls_server

    async def run() -> bytes:
        async with AsyncClient(port=port, tls=ctx, tls_server_name="localhost") as kv:
            await kv.put(NS, b"a1", None, b"x" * 300_000)
            return bytes(await kv.get(NS, b"a1"))

    assert asyncio.run(run()) == b"x" * 300_000
