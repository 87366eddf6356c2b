"""S3 tier put/get throughput against raw boto3 put_object/get_object, same endpoint, same run.

    python bench/bench_s3.py                      # starts moto_server on a free loopback port
    python bench/bench_s3.py --endpoint http://127.0.0.1:9000 --bucket kvstrata   # e.g. MinIO

The raw peer uses a boto3 client with the tier's botocore settings (path addressing, no CRC
trailers) and reads the body with ``.read()`` into new bytes; the tier reads into a caller's
buffer and verifies the xxh3-128 checksum. Requests are sequential (one in flight) so the
figures compare per-request cost; with moto both sides are bounded by moto's Python server.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstrata.store.keys import ChunkKey, ChunkMeta
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


async def compare(raw: RawPeer, tier: TierPeer, op: str, reps: int, rounds: int) -> list[float]:
    """Median MB/s of raw and tier, rounds alternating so drift hits both sides alike."""
    samples: dict[str, list[float]] = {"raw": [], "tier": []}
    await getattr(raw, op)()  # warm-up: connections, first allocation
    await getattr(tier, op)()
    for _ in range(rounds):
        for name, peer in (("raw", raw), ("tier", tier)):
            seconds = await timed(getattr(peer, op), reps)
            samples[name].append(rate(len(raw.data) * reps, seconds))
    return [median(samples["raw"]), median(samples["tier"])]


def run(endpoint: str, bucket: str, region: str, sizes: list[int], budget: int) -> None:
    client = raw_client(endpoint, region)
    config = S3Config(bucket=bucket, endpoint=endpoint, region=region, prefix="bench")
    rows: list[tuple[str, str, float, float]] = []
    rounds = 5

    async def runs() -> None:
        tier = S3Tier(config)
        try:
            for size in sizes:
                data = np.random.default_rng(size).integers(0, 256, size * MiB, np.uint8).tobytes()
                reps = max(1, budget // size // rounds)
                raw_peer, tier_peer = RawPeer(client, bucket, data), TierPeer(tier, data)
                for op in ("put", "get"):
                    raw_rate, tier_rate = await compare(raw_peer, tier_peer, op, reps, rounds)
                    rows.append((f"{size} MiB", op, raw_rate, tier_rate))
        finally:
            await tier.close()

    asyncio.run(runs())
    print(f"endpoint {endpoint}: sequential requests, median of {rounds} alternating rounds, "
          "MB/s (1e6 B/s)")  # fmt: skip
    print(f"{'size':>7} {'op':>4} {'raw boto3':>10} {'S3Tier':>10} {'tier/raw':>9}")
    for size_label, op, raw, tier_rate in rows:
        print(f"{size_label:>7} {op:>4} {raw:10.1f} {tier_rate:10.1f} {tier_rate / raw:9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", help="S3 endpoint; default: start moto_server")
    parser.add_argument("--bucket", default="", help="existing bucket (default: create one)")
    parser.add_argument("--region", default="us-east-1")
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="MiB list")
    parser.add_argument("--budget", type=int, default=128, help="MiB moved per size, op and side")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
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
