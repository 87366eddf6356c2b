"""The docker-compose topology without Docker: a real ``kvstrata serve`` subprocess pointed at
a moto S3 server on loopback (``--s3-endpoint``/``--s3-bucket``), driven by redis-py.

A chain PUT through the server lands in the bucket (write-through); a second server with an
empty data folder finds it there; a server whose S3 endpoint is down still starts and serves.

Credentials: the ``aws_test_env`` fixture puts dummy ones in this process's environment,
which the server subprocess inherits.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import redis

from kvstrata.chunks import ChunkKey
from kvstrata.tiers.s3 import object_name
from tests.conftest import RunningServer, free_port

if TYPE_CHECKING:
    from tests.s3fixture import MotoServer

pytest_plugins = ["tests.s3fixture"]

NS = "topo@bf16@c4"


def client(srv: RunningServer) -> redis.Redis:
    return redis.Redis(host=srv.host, port=srv.port, protocol=3, socket_timeout=30)


def test_serve_subprocess_with_moto_s3(
    make_process_server: Callable[..., RunningServer],
    moto_server: MotoServer,
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    flags = {"s3_endpoint": moto_server.endpoint, "s3_bucket": s3_bucket,
             "s3_write_policy": "write-through"}  # fmt: skip
    a = make_process_server(data_dir=tmp_path / "a", **flags)
    ra = client(a)
    hashes = [b"t%02d" % i for i in range(3)]
    parent = b""
    for i, h in enumerate(hashes):
        assert ra.execute_command("KV.PUT", NS, h, parent, bytes([i]) * 100_000) == 1
        parent = h
    tiers = dict(ra.info("tiers"))
    assert tiers["tiers"] == ["dram", "nvme", "s3"] and tiers["s3_bucket"] == s3_bucket
    listed = moto_server.client().list_objects_v2(Bucket=s3_bucket)["Contents"]
    assert {o["Key"] for o in listed} == {object_name("kvstrata", ChunkKey(NS, h)) for h in hashes}

    b = make_process_server(data_dir=tmp_path / "b", **flags)
    rb = client(b)
    assert dict(rb.info("persistence"))["rebuild_chunks"] == 0  # the bucket is not scanned
    assert rb.execute_command("KV.MATCH", NS, *hashes, b"t99") == 3
    assert rb.execute_command("KV.GET", NS, hashes[2]) == bytes([2]) * 100_000


def test_serve_starts_and_serves_while_s3_is_down(
    make_process_server: Callable[..., RunningServer],
    aws_test_env: dict[str, str],
    tmp_path: Path,
) -> None:
    srv = make_process_server(
        data_dir=tmp_path / "down",
        s3_endpoint=f"http://127.0.0.1:{free_port()}",
        s3_bucket="nowhere",
        s3_timeout="1",
        s3_write_policy="write-through",
    )
    r = client(srv)
    assert r.ping()
    assert r.execute_command("KV.PUT", NS, b"a", b"", b"x" * 1000) == 1
    assert r.execute_command("KV.MATCH", NS, b"a", b"b") == 1
    assert r.execute_command("KV.GET", NS, b"a") == b"x" * 1000
    assert dict(r.info("tiers"))["s3_errors"] >= 1
