"""``s3-codec``: chunks coded losslessly as they are uploaded (moto's server), decoded when they
are read back, on this node or another; the coding is part of the object's authenticated
metadata, and a coded object that was tampered with is a miss or an integrity error, never
wrong bytes."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

import pytest
import torch

from kvstrata.chunks import ChunkKey
from kvstrata.clients.layout import pack_chunk
from kvstrata.codecs import entropy
from kvstrata.tiers.base import ChunkMissing, IntegrityError
from kvstrata.tiers.s3 import object_name
from tests.fakes import make_dram, meta_for, open_store, s3_tier

if TYPE_CHECKING:
    from tests.s3fixture import MotoServer

pytest_plugins = ["tests.s3fixture"]
pytestmark = pytest.mark.skipif(not entropy.have_rans(), reason="C extension not built")

NS = "codec@bf16@c64"
KEY = "k" * 32


def run(coro: Awaitable[Any]) -> Any:
    async def guarded() -> Any:
        return await asyncio.wait_for(coro, 90)

    return asyncio.run(guarded())


def payload(codec: str = "raw", seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(1, 4, 1, 64, generator=g))
    kv = [(torch.randn(2, 4, 64, 64, generator=g) * scale).to(torch.bfloat16) for _ in range(2)]
    return bytes(pack_chunk(list(kv[0]), list(kv[1]), codec))


async def put_get(tier: Any, data: bytes, h: bytes = b"c1") -> tuple[Any, bytes]:
    meta = meta_for(NS, h, data, tokens=64)
    await tier.put(meta, data)
    out = bytearray(len(data))
    await tier.get(meta.key, memoryview(out))
    return meta, bytes(out)


@pytest.mark.parametrize("codec,kind,encoding", [
    ("bf16x", "raw", "bf16x"), ("auto", "raw", "bf16x"), ("auto", "int4", "int4e"),
    ("int4e", "int4", "int4e"),
])  # fmt: skip
def test_coded_upload_reads_back_bit_exact(
    moto_server: MotoServer, s3_bucket: str, codec: str, kind: str, encoding: str
) -> None:
    async def main() -> None:
        data = payload(kind)
        tier = s3_tier(moto_server, s3_bucket, codec=codec)
        plain = s3_tier(moto_server, s3_bucket)  # a node without s3-codec reads it too
        try:
            meta, back = await put_get(tier, data)
            assert back == data
            head = moto_server.client().head_object(
                Bucket=s3_bucket, Key=object_name("kvstrata", meta.key)
            )
            md = head["Metadata"]
            assert md["kvs-version"] == "2" and md["kvs-encoding"] == encoding
            assert int(md["kvs-size"]) == len(data)
            assert head["ContentLength"] == int(md["kvs-stored-size"]) < 0.97 * len(data)
            assert tier.stats.extra["coded_puts"] == 1
            assert tier.stats.extra["coded_bytes_saved"] == len(data) - head["ContentLength"]
            out = bytearray(len(data))
            got = await plain.get(meta.key, memoryview(out))
            assert bytes(out) == data and got.checksum == meta.checksum
        finally:
            await tier.close()
            await plain.close()

    run(main())


def test_what_does_not_shrink_is_stored_as_put(moto_server: MotoServer, s3_bucket: str) -> None:
    async def main() -> None:
        tier = s3_tier(moto_server, s3_bucket, codec="auto")
        try:
            for i, data in enumerate([random.Random(1).randbytes(50_000), payload("int8")]):
                meta, back = await put_get(tier, data, h=b"r%d" % i)
                assert back == data
                md = moto_server.client().head_object(
                    Bucket=s3_bucket, Key=object_name("kvstrata", meta.key)
                )
                assert md["Metadata"]["kvs-version"] == "1" and md["ContentLength"] == len(data)
            assert tier.stats.extra["coded_puts"] == 0
        finally:
            await tier.close()

    run(main())


def _replace(server: MotoServer, bucket: str, key: ChunkKey, **md: str) -> None:
    """Rewrite an object's metadata behind the tier's back."""
    client = server.client()
    name = object_name("kvstrata", key)
    obj = client.get_object(Bucket=bucket, Key=name)
    client.put_object(Bucket=bucket, Key=name, Body=obj["Body"].read(),
                      Metadata={**obj["Metadata"], **md})  # fmt: skip


@pytest.mark.parametrize("auth", [False, True])
def test_a_forged_encoding_is_never_decoded_into_wrong_bytes(
    moto_server: MotoServer, s3_bucket: str, auth: bool
) -> None:
    async def main() -> None:
        kw = {"auth_key": KEY.encode()} if auth else {}
        tier = s3_tier(moto_server, s3_bucket, codec="bf16x", **kw)
        try:
            data = payload()
            meta, _ = await put_get(tier, data)
            _replace(moto_server, s3_bucket, meta.key, **{"kvs-encoding": "fp16x"})
            out = bytearray(len(data))
            with pytest.raises(ChunkMissing if auth else IntegrityError):
                await tier.get(meta.key, memoryview(out))
            if auth:
                assert tier.stats.extra["auth_failures"] == 1
        finally:
            await tier.close()

    run(main())


def test_a_tampered_coded_body_is_an_integrity_error(
    moto_server: MotoServer, s3_bucket: str
) -> None:
    async def main() -> None:
        tier = s3_tier(moto_server, s3_bucket, codec="bf16x")
        try:
            data = payload()
            meta, _ = await put_get(tier, data)
            client, name = moto_server.client(), object_name("kvstrata", meta.key)
            obj = client.get_object(Bucket=s3_bucket, Key=name)
            body, md = obj["Body"].read(), obj["Metadata"]
            for at in (5, 40, len(body) // 2, len(body) - 1):  # header, table, stream, plane
                bad = bytearray(body)
                bad[at] ^= 0x10
                client.put_object(Bucket=s3_bucket, Key=name, Body=bytes(bad), Metadata=md)
                with pytest.raises(IntegrityError):
                    await tier.get(meta.key, memoryview(bytearray(len(data))))
                client.put_object(Bucket=s3_bucket, Key=name, Body=body, Metadata=md)
            out = bytearray(len(data))
            await tier.get(meta.key, memoryview(out))
            assert bytes(out) == data
        finally:
            await tier.close()

    run(main())


def test_two_nodes_share_coded_chunks(moto_server: MotoServer, s3_bucket: str) -> None:
    """Node A (s3-codec auto, write-through) stores a chain; node B, without the option,
    matches it and reads every chunk back as it was put."""

    async def main() -> None:
        tier_a = s3_tier(moto_server, s3_bucket, codec="auto")
        async with (
            open_store([make_dram(), tier_a], s3_write_policy="write-through") as a,
            open_store([make_dram(), s3_tier(moto_server, s3_bucket)]) as b,
        ):
            chunks = [payload("raw", seed=i) for i in range(3)]
            parent = b""
            for i, data in enumerate(chunks):
                h = b"h%d" % i
                assert await a.put(NS, h, parent, data, tokens=64)
                parent = h

            async def uploaded() -> bool:
                return tier_a.stats.extra["coded_puts"] == 3

            for _ in range(2000):
                if await uploaded():
                    break
                await asyncio.sleep(0.01)
            assert await uploaded()
            assert len(await b.match_all(NS, [b"h0", b"h1", b"h2"])) == 3
            for i, data in enumerate(chunks):
                got = await b.get(NS, b"h%d" % i)
                assert got is not None
                try:
                    assert bytes(got.view) == data
                finally:
                    if got.release:
                        got.release()

    run(main())


def test_transformers_logits_through_bf16x_are_bit_identical(
    make_server: Any, moto_server: MotoServer, s3_bucket: str
) -> None:
    """The engine bar: node A (s3-codec bf16x, write-through) stores a bf16 Llama's prefix;
    node B (no codec, empty DRAM) restores it from S3, decoded. B's next-token logits equal a
    recompute split at the same place, bit for bit, as a raw restore's do."""
    pytest.importorskip("transformers")
    from kvstrata.clients.hf import HFPrefixCache
    from kvstrata.clients.sync import Client
    from tests.hf_fakes import recompute_logits, tiny_llama

    model = tiny_llama(dtype=torch.bfloat16)
    s3 = {"s3_bucket": s3_bucket, "s3_endpoint": moto_server.endpoint}
    a = make_server(**s3, s3_write_policy="write-through", s3_codec="bf16x")
    b = make_server(**s3)
    ids = torch.randint(0, 500, (1, 70), generator=torch.Generator().manual_seed(3))
    with Client(port=a.port) as kv_a, Client(port=b.port) as kv_b:
        writer = HFPrefixCache(model, kv_a, chunk_tokens=16)
        writer.prefill(ids[:, :64])
        assert writer.wait_stored() == 4
        client = moto_server.client()
        deadline = time.monotonic() + 30  # write-through uploads may finish after the reply
        while len(client.list_objects_v2(Bucket=s3_bucket).get("Contents", [])) < 4:
            assert time.monotonic() < deadline, "A's chunks never reached S3"
            time.sleep(0.01)
        reader = HFPrefixCache(model, kv_b, chunk_tokens=16)
        res = reader.prefill(ids, store=False)
        assert res.reused_tokens == 64
        assert torch.equal(res.logits, recompute_logits(model, ids, split=64))
        writer.close()
        reader.close()
    names = [o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket)["Contents"]]
    heads = [client.head_object(Bucket=s3_bucket, Key=n) for n in names]
    assert len(heads) == 4
    for head in heads:  # what B read was coded: bf16x objects, smaller than the chunks
        assert head["Metadata"]["kvs-encoding"] == "bf16x"
        assert head["ContentLength"] < int(head["Metadata"]["kvs-size"])
