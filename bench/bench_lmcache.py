"""LMCache 0.5.6 remote storage: put/get GB/s and the existence check of 500 chunks, by route.

Run in the LMCache venv (``scripts/engines/lmcache.sh --install-only`` makes it)::

    PYTHONPATH=$PWD ~/.cache/kvstrata/venvs/lmcache-0.5.6/bin/python bench/bench_lmcache.py

Routes, all through LMCache's own ``RemoteBackend`` (what its cache engine calls), measured in
this run side by side:

- (a) the built-in ``RedisConnector`` (``remote_url: redis://``) against redis-server — the peer;
- (b) the same connector against kvstrata (the route with no code);
- (c) kvstrata's ``KvstrataConnector`` plugin (``remote_storage_plugins``).

Chunks of 1, 8 and 32 MiB (fp16, 256 tokens, 1/8/32 layers of 8 heads × 128): GB/s of a batched
write (``connection.batched_put``, as ``batched_submit_put_task`` sends it) and of a batched
read (``batched_get_blocking``) of ``--bytes`` per size; then ``batched_contains`` of 500
stored 4 KiB chunks (LMCache's lookup of a 128k-token prompt), median latency.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
logging.disable(logging.WARNING)

from _servers import kvstrata_server, redis_server  # noqa: E402

from tests.engines.lmcache.harness import Stack, make_stack, plugin_extra  # noqa: E402

ROUTES = ("a RedisConnector→redis", "b RedisConnector→kvstrata", "c kvstrata plugin")


def stack_for(
    route: int, redis_port: int, kv_port: int, layers: int, chunk: int, mib: int
) -> Stack:
    cpu_gib = (mib * 1.25 + 16) / 1024  # LMCache's CPU buffer: one round's chunks
    shape = {"layers": layers, "chunk_size": chunk, "heads": 8, "head_dim": 128, "cpu_gib": cpu_gib}
    if route == 0:
        return make_stack(remote_url=f"redis://127.0.0.1:{redis_port}", **shape)
    if route == 1:
        return make_stack(remote_url=f"redis://127.0.0.1:{kv_port}", **shape)
    return make_stack(extra=plugin_extra(f"redis://127.0.0.1:{kv_port}"), **shape)


def put_get(s: Stack, n: int, repeat: int, base: int) -> tuple[float, float]:
    """Median GB/s of writing then reading ``n`` chunks, fresh keys each round."""
    puts, gets = [], []
    nbytes = 0
    for r in range(repeat):
        keys = [s.key(base + r * n + i) for i in range(n)]
        objs = [s.chunk(seed=i) for i in range(n)]
        nbytes = sum(o.get_size() for o in objs)
        t = time.perf_counter()
        s.put(keys, objs, timeout=300)
        puts.append(nbytes / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        got = s.backend.batched_get_blocking(keys)
        gets.append(nbytes / (time.perf_counter() - t) / 1e9)
        if any(g is None for g in got):
            raise RuntimeError("a chunk written was not read back")
        for g in got:
            g.ref_count_down()
    return statistics.median(puts), statistics.median(gets)


def lookup_ms(s: Stack, repeat: int) -> float:
    keys = [s.key(10**6 + i) for i in range(500)]
    for i in range(0, 500, 50):
        s.put(keys[i : i + 50], [s.chunk(seed=j) for j in range(50)])
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        hit = s.backend.batched_contains(keys)
        times.append((time.perf_counter() - t) * 1e3)
        if hit != 500:
            raise RuntimeError(f"lookup found {hit} of 500")
    return statistics.median(times)


def run_route(route: int, ports: tuple[int, int], args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mib in (1, 8, 32):
        n = max(2, args.bytes // mib)
        s = stack_for(route, *ports, layers=mib, chunk=256, mib=args.bytes)
        try:
            out[mib] = put_get(s, n, args.repeat, base=mib * 10**4)
        finally:
            s.close()
    s = stack_for(route, *ports, layers=1, chunk=1, mib=8)  # 4 KiB chunks
    try:
        out["lookup"] = lookup_ms(s, args.repeat)
    finally:
        s.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bytes", type=int, default=64, help="MiB written and read per size")
    args = ap.parse_args()
    with ExitStack() as st:
        rs = st.enter_context(redis_server())
        kv = st.enter_context(kvstrata_server("--dram-capacity", "2GiB", "--nvme-capacity", "0"))
        results = [run_route(r, (rs.port, kv.port), args) for r in range(3)]
    fmt: Callable[[float], str] = lambda v: f"{v:.2f}"  # noqa: E731
    print("\nput / get GB/s (median), batched_contains of 500 chunks (ms)\n")
    print(
        "| route | "
        + " | ".join(f"{m} MiB put | {m} MiB get" for m in (1, 8, 32))
        + " | 500-chunk lookup ms |"
    )
    print("|---" * 8 + "|")
    for name, res in zip(ROUTES, results, strict=True):
        cells = [fmt(x) for m in (1, 8, 32) for x in res[m]]
        print(f"| {name} | " + " | ".join(cells) + f" | {res['lookup']:.1f} |")


if __name__ == "__main__":
    main()
