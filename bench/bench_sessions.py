"""Multi-turn sessions with and without session prefetch: where each load finds its chunks.

    python bench/bench_sessions.py                # starts moto_server on a free loopback port
    python bench/bench_sessions.py --sessions 32 --turns 8

Many sessions take turns round-robin; at each turn a session loads its whole conversation so
far (KV.MATCH + KV.LEASE through the store API), then appends new chunks and records its tail
(KV.SESSION). The working set is larger than DRAM + NVMe, so by the time a session comes back
its chunks have been demoted to NVMe or written back to S3 (moto). With prefetch, the hint for
a session arrives ``--lookahead`` turns before its turn (a user typing):
``KV.PREFETCH ns SESSION id``. Both modes run the same workload, each on a fresh store and
bucket, in the same process; the table gives the tier each loaded chunk was in when its load
started and the load (lease) latency.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstrata.config import load_config
from kvstrata.store.keyspace import Keyspace
from kvstrata.store.kvstore import KVStore

NS = "bench@bf16@c256"
MiB = 1024 * 1024


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


async def workload(store: KVStore, args: argparse.Namespace, prefetch: bool) -> dict[str, Any]:
    chains: list[list[bytes]] = [[] for _ in range(args.sessions)]
    tiers: dict[str, int] = {}
    latencies: list[float] = []
    payload = bytes(range(256)) * (args.chunk_kib * 4)
    order = [(t, s) for t in range(args.turns) for s in range(args.sessions)]
    started = time.perf_counter()
    for step, (_, s) in enumerate(order):
        if prefetch and step + args.lookahead < len(order):
            _, ahead = order[step + args.lookahead]
            store.prefetch_session(NS, b"s%d" % ahead)
        chain = chains[s]
        if chain:
            records = await store.match_all(NS, chain)
            for name in store.tiers_of(records):
                tiers[name] = tiers.get(name, 0) + 1
            t0 = time.perf_counter()
            lease = await store.lease(NS, chain)
            latencies.append((time.perf_counter() - t0) * 1000)
            if lease is not None:
                store.release(lease.id)
        for _ in range(args.chunks_per_turn):
            h = uuid.uuid4().bytes + uuid.uuid4().bytes
            await store.put(NS, h, chain[-1] if chain else b"", payload, tokens=256)
            chain.append(h)
        store.record_session(NS, b"s%d" % s, chain[-1])
        await asyncio.sleep(args.think_ms / 1000)  # the user reads and types
    elapsed = time.perf_counter() - started
    pf = dict(store.info_sections()["prefetch"])
    return {"tiers": tiers, "lat": latencies, "pf": pf, "seconds": elapsed}


async def run_mode(endpoint: str, bucket: str, args: argparse.Namespace, prefetch: bool) -> Any:
    with tempfile.TemporaryDirectory(prefix="kvs-bench-") as tmp:
        config = load_config(
            flags={
                "data-dir": tmp,
                "dram-capacity": f"{args.dram_mib}MiB",
                "nvme-capacity": f"{args.nvme_mib}MiB",
                "s3-endpoint": endpoint,
                "s3-bucket": bucket,
                "prefetch-concurrency": "4",
            },
            env={},
        )
        store = await KVStore.from_config(config, Keyspace())
        await store.start()
        try:
            return await workload(store, args, prefetch)
        finally:
            await store.close()


def report(rows: list[tuple[str, dict[str, Any]]], args: argparse.Namespace) -> None:
    working = args.sessions * args.turns * args.chunks_per_turn * args.chunk_kib / 1024
    print(
        f"{args.sessions} sessions x {args.turns} turns, {args.chunks_per_turn} chunks of "
        f"{args.chunk_kib} KiB per turn; working set {working:.0f} MiB; DRAM {args.dram_mib} "
        f"MiB, NVMe {args.nvme_mib} MiB, S3 = moto; prefetch lookahead {args.lookahead} turns"
    )
    heads = [("mode", 12), ("loads", 6), ("chunks", 7), ("dram%", 6), ("nvme%", 6), ("s3%", 6),
             ("p50 ms", 8), ("p99 ms", 8), ("pf done", 8), ("pf late", 8), ("pf MiB", 7),
             ("run s", 6)]  # fmt: skip
    print(" ".join(f"{h:>{w}}" for h, w in heads))
    for name, r in rows:
        total = sum(r["tiers"].values()) or 1
        pct = [100 * r["tiers"].get(t, 0) / total for t in ("dram", "nvme", "s3")]
        pf = r["pf"]
        cells = [name, len(r["lat"]), total, *(f"{p:.1f}" for p in pct),
                 f"{percentile(r['lat'], 0.5):.2f}", f"{percentile(r['lat'], 0.99):.2f}",
                 pf["prefetch_done"], pf["prefetch_late"], f"{pf['prefetch_bytes'] / MiB:.1f}",
                 f"{r['seconds']:.1f}"]  # fmt: skip
        print(" ".join(f"{c!s:>{w}}" for c, (_, w) in zip(cells, heads, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=24)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--chunks-per-turn", type=int, default=2)
    parser.add_argument("--chunk-kib", type=int, default=256)
    parser.add_argument("--dram-mib", type=int, default=16)
    parser.add_argument("--nvme-mib", type=int, default=32)
    parser.add_argument("--lookahead", type=int, default=3)
    parser.add_argument("--think-ms", type=float, default=20.0)
    args = parser.parse_args()
    logging.getLogger("kvstrata").setLevel(logging.ERROR)  # write-back retries are expected
    from tests.s3fixture import DUMMY_ENV, MotoServer

    os.environ.update(DUMMY_ENV)
    rows = []
    with MotoServer() as server:
        for name, prefetch in (("no prefetch", False), ("prefetch", True)):
            result = asyncio.run(run_mode(server.endpoint, server.make_bucket(), args, prefetch))
            rows.append((name, result))
    report(rows, args)


if __name__ == "__main__":
    main()
