"""S3 tier put/get throughput, with and without ``s3-auth-key``, against raw boto3
put_object/get_object, same endpoint, same run; and index memory per remote record.

    python bench/bench_s3.py                      # starts moto_server on a free loopback port
    python bench/bench_s3.py --endpoint http://127.0.0.1:9000 --bucket kvstrata   # e.g. MinIO

The raw peer uses a boto3 client with the tier's botocore settings (path addressing, no CRC
trailers) and reads the body with ``.read()`` into new bytes; the tier reads into a caller's
buffer and verifies the xxh3-128 checksum; the authenticated tier also computes (put) and
checks (get) the HMAC-SHA256 tag over metadata and payload. A fourth column is the HMAC alone
over the same bytes in memory (the ceiling the tag puts on one connection). Requests are
sequential (one in flight) so the figures compare per-request cost; with moto all sides are
bounded by moto's Python server.

``--codec bf16x`` (or ``int4e``, ``auto``) compares instead the tier without and with
``s3-codec`` on KV-like payloads (bf16 with per-channel outlier scales, packed as ``KVST``;
int4 of the same for ``int4e``): MB/s of the chunk's bytes as put, and the bytes stored.

The memory figure: ``--records`` chunk records adopted from a shared tier (index record,
keyspace entry, LRU entry of ``s3-max-remote-records``), measured with tracemalloc.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.tiers.checksum import checksum
from kvstrata.tiers.s3 import S3Config, S3Tier

MiB = 1024 * 1024
DEFAULT_SIZES = (1, 8, 32)


def raw_client(endpoint: str, region: str) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=region,
        config=Config(
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )


def rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6 if seconds > 0 else float("inf")


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


class RawPeer:
    """put_object / get_object().read() on one key."""

    def __init__(self, client: Any, bucket: str, data: bytes) -> None:
        self.client, self.bucket, self.data = client, bucket, data
        self.key = f"raw/{uuid.uuid4().hex}"

    async def put(self) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.key, Body=self.data)

    async def get(self) -> None:
        body = self.client.get_object(Bucket=self.bucket, Key=self.key)["Body"].read()
        assert len(body) == len(self.data)


class TierPeer:
    """S3Tier.put / S3Tier.get into a preallocated buffer, on one chunk."""

    def __init__(self, tier: S3Tier, data: bytes) -> None:
        self.tier, self.data = tier, data
        key = ChunkKey("bench@s3", uuid.uuid4().bytes)
        self.meta = ChunkMeta(key, b"", 256, len(data), checksum(data))
        self.out = memoryview(bytearray(len(data)))

    async def put(self) -> None:
        await self.tier.put(self.meta, self.data)

    async def get(self) -> None:
        await self.tier.get(self.meta.key, self.out)


async def timed(op: Callable[[], Awaitable[None]], reps: int) -> float:
    started = time.perf_counter()
    for _ in range(reps):
        await op()
    return time.perf_counter() - started


async def compare(peers: list[Any], op: str, reps: int, rounds: int) -> list[float]:
    """Median MB/s of each peer, rounds alternating so drift hits every side alike."""
    samples: list[list[float]] = [[] for _ in peers]
    for peer in peers:
        await getattr(peer, op)()  # warm-up: connections, first allocation
    for _ in range(rounds):
        for i, peer in enumerate(peers):
            seconds = await timed(getattr(peer, op), reps)
            samples[i].append(rate(len(peer.data) * reps, seconds))
    return [median(s) for s in samples]


def hmac_rate(data: bytes, reps: int = 3) -> float:
    started = time.perf_counter()
    for _ in range(reps):
        hmac.new(b"k" * 32, data, hashlib.sha256).digest()
    return rate(len(data) * reps, time.perf_counter() - started)


def run(endpoint: str, bucket: str, region: str, sizes: list[int], budget: int) -> None:
    client = raw_client(endpoint, region)
    config = S3Config(bucket=bucket, endpoint=endpoint, region=region, prefix="bench")
    authed = S3Config(bucket=bucket, endpoint=endpoint, region=region, prefix="bench-auth",
                      auth_key=b"bench-auth-key-0123456789")  # fmt: skip
    rows: list[tuple[str, str, list[float], float]] = []
    rounds = 5

    async def runs() -> None:
        tier, tier_auth = S3Tier(config), S3Tier(authed)
        try:
            for size in sizes:
                data = np.random.default_rng(size).integers(0, 256, size * MiB, np.uint8).tobytes()
                reps = max(1, budget // size // rounds)
                peers = [RawPeer(client, bucket, data), TierPeer(tier, data),
                         TierPeer(tier_auth, data)]  # fmt: skip
                mac = hmac_rate(data)
                for op in ("put", "get"):
                    rows.append((f"{size} MiB", op, await compare(peers, op, reps, rounds), mac))
        finally:
            await tier.close()
            await tier_auth.close()

    asyncio.run(runs())
    print(f"endpoint {endpoint}: sequential requests, median of {rounds} alternating rounds, "
          "MB/s (1e6 B/s)")  # fmt: skip
    print(f"{'size':>7} {'op':>4} {'raw boto3':>10} {'S3Tier':>10} {'+auth':>10} "
          f"{'tier/raw':>9} {'auth/raw':>9} {'HMAC only':>10}")  # fmt: skip
    for size_label, op, (raw, plain, auth), mac in rows:
        print(f"{size_label:>7} {op:>4} {raw:10.1f} {plain:10.1f} {auth:10.1f} "
              f"{plain / raw:9.2f} {auth / raw:9.2f} {mac:10.1f}")  # fmt: skip


def kv_payload(size: int, codec: str) -> bytes:
    """About ``size`` bytes of KVST payload: bf16 KV with per-channel outlier scales."""
    import torch

    from kvstrata.clients.layout import pack_chunk

    g = torch.Generator().manual_seed(size)
    tokens = max(1, size // (2 * 8 * 8 * 128 * 2))
    scale = torch.exp(1.2 * torch.randn(8, 8, 1, 128, generator=g))
    kv = [(torch.randn(8, 8, tokens, 128, generator=g) * scale).to(torch.bfloat16)
          for _ in range(2)]  # fmt: skip
    return bytes(pack_chunk(list(kv[0]), list(kv[1]), "int4" if codec == "int4e" else "raw"))


def run_codec(endpoint: str, bucket: str, region: str, sizes: list[int], budget: int,
              codec: str) -> None:  # fmt: skip
    plain = S3Config(bucket=bucket, endpoint=endpoint, region=region, prefix="bench")
    coded = S3Config(bucket=bucket, endpoint=endpoint, region=region, prefix="bench-coded",
                     codec=codec)  # fmt: skip
    rows: list[tuple[int, str, list[float], float]] = []
    rounds = 5

    async def runs() -> None:
        tier, tier_coded = S3Tier(plain), S3Tier(coded)
        try:
            for size in sizes:
                data = kv_payload(size * MiB, codec)
                reps = max(1, budget // size // rounds)
                peers = [TierPeer(tier, data), TierPeer(tier_coded, data)]
                saved = tier_coded.stats.extra["coded_bytes_saved"]
                await peers[1].put()
                stored = len(data) - (tier_coded.stats.extra["coded_bytes_saved"] - saved)
                for op in ("put", "get"):
                    got = await compare(peers, op, reps, rounds)
                    rows.append((len(data), op, got, len(data) / stored))
        finally:
            await tier.close()
            await tier_coded.close()

    asyncio.run(runs())
    print(f"endpoint {endpoint}: s3-codec none vs {codec}, sequential requests, median of "
          f"{rounds} alternating rounds, MB/s of the chunk as put (1e6 B/s)")  # fmt: skip
    print(f"{'bytes':>10} {'op':>4} {'none':>8} {codec:>8} {'ratio':>6} {'stored x':>9}")
    for nbytes, op, (raw, with_codec), ratio in rows:
        print(f"{nbytes:>10} {op:>4} {raw:8.1f} {with_codec:8.1f} {with_codec / raw:6.2f} "
              f"{ratio:9.3f}")  # fmt: skip


def record_memory(count: int) -> None:
    """Bytes of index memory per record of a chunk held only in the shared tier."""
    import tracemalloc

    from tests.fakes import FakeTier, make_dram, open_store

    async def measure() -> tuple[float, int]:
        async with open_store([make_dram(1 << 20), FakeTier("s3")],
                              s3_max_remote_records=count) as store:  # fmt: skip
            metas, parent = [], b""
            for i in range(count):  # chains of 500 chunks (128k-token prompts)
                h = os.urandom(32)
                metas.append(ChunkMeta(ChunkKey("llama-3.1-8b@bf16@tp1r0@c256", h),
                                       b"" if i % 500 == 0 else parent, 256, 8 * MiB,
                                       os.urandom(16)))  # fmt: skip
                parent = h
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            for meta in metas:
                store.remote.adopt(meta)
            after = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
            assert len(store.index) == count and len(store.remote.records) == count
            return (after - before) / count, len(store.index)

    per, n = asyncio.run(measure())
    print(f"\nindex memory per remote record (tracemalloc, {n} records in chains of 500, "
          f"32-byte hashes): {per:.0f} B; s3-max-remote-records at its default (1,000,000): "
          f"about {per * 1e6 / 2**20:.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", help="S3 endpoint; default: start moto_server")
    parser.add_argument("--bucket", default="", help="existing bucket (default: create one)")
    parser.add_argument("--region", default="us-east-1")
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="MiB list")
    parser.add_argument("--budget", type=int, default=128, help="MiB moved per size, op and side")
    parser.add_argument("--records", type=int, default=100_000, help="remote records to measure")
    parser.add_argument("--codec", help="compare s3-codec none with this one (bf16x, int4e…)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.codec:
        from tests.s3fixture import DUMMY_ENV, MotoServer

        os.environ.update(DUMMY_ENV)
        with MotoServer() as server:
            run_codec(server.endpoint, server.make_bucket(), args.region, sizes, args.budget,
                      args.codec)  # fmt: skip
        return
    record_memory(args.records)
    if args.endpoint:
        bucket = args.bucket or f"kvstrata-bench-{uuid.uuid4().hex[:8]}"
        if not args.bucket:
            raw_client(args.endpoint, args.region).create_bucket(Bucket=bucket)
        run(args.endpoint, bucket, args.region, sizes, args.budget)
        return
    from tests.s3fixture import DUMMY_ENV, MotoServer

    os.environ.update(DUMMY_ENV)
    with MotoServer() as server:
        run(server.endpoint, server.make_bucket(), args.region, sizes, args.budget)


if __name__ == "__main__":
    main()
