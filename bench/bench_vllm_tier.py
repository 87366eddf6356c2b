"""vLLM secondary tiers side by side: the kvstrata tier vs vLLM's own ``fs`` tier (vLLM 0.33).

Runs in the vLLM venv (``scripts/engines/vllm.sh --install-only`` makes it)::

    PYTHONPATH=. ~/.cache/kvstrata/venvs/vllm-0.33.0/bin/python bench/bench_vllm_tier.py
    ... bench/bench_vllm_tier.py --row-mib 2 --rows 32 --fs-dir /mnt/nvme/x   # fs on a real disk

Both tiers are built by ``SecondaryTierFactory`` over the same primary buffer (``--rows`` rows
of ``--row-mib`` MiB, i.e. the same vLLM chunk size) and timed the way vLLM uses them: one job
of all rows submitted, then ``get_finished_jobs`` polled until it is reported. Rows:

- store and load GB/s: kvstrata (same host: KV.MRESERVE + one memcpy per row + KV.COMMIT,
  and lease + one memcpy; and
  ``load=mget``: KV.MGET received in place), vLLM ``fs`` (``--fs-dir``; O_DIRECT when the
  filesystem takes it, buffered otherwise: a tmpfs or page-cached file is a memory copy too),
  and ``np.copyto`` of the same bytes (the one-copy bound);
- lookup latency of a 500-chunk prefix: from the first ``lookup`` scan (all RETRY) through
  ``on_schedule_end`` to the scan that resolves all 500 (kvstrata: one ``KV.MATCH``; fs: its
  async lookup thread, one ``faccessat`` per file), and the same 500 keys as 500 ``KV.MATCH``
  round trips of one key (the per-block pattern the tier avoids). The kvstrata tier answers
  a prefix it stored itself (or saw matched) within ``lookup_cache_s`` from its recent-hit
  cache (issue 31). The ``fs`` tier keeps each key's verdict while a request that asked for
  it is unfinished, and the bench's first five lookups are never finished: its plain lookup
  row is its remembered-verdict path. "cold" rows: each lookup's request finishes after it
  (``on_request_finished``, as in an engine), and the kvstrata tier's recent-hit cache is
  cleared before it: kvstrata's KV.MATCH path beside the fs tier's faccessat thread.
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstrata.clients import Client
from tests.conftest import start_process_server
from tests.engines.vllm.harness import (
    END,
    SpecForTier,
    chain_keys,
    offloading_config,
)

MiB = 1 << 20


def page_aligned(rows: int, row_bytes: int) -> np.ndarray:
    """Rows in an anonymous mmap, like vLLM's primary tier (O_DIRECT needs aligned buffers)."""
    return np.frombuffer(mmap.mmap(-1, rows * row_bytes), dtype=np.int8).reshape(rows, -1)


def make_tier(kind: str, buffer: np.ndarray, row_bytes: int, port: int, fs_dir: str) -> Any:
    from vllm.v1.kv_offload.config import OffloadingConfig
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    base = offloading_config()
    config = OffloadingConfig(**{**base.__dict__, "worker_kv_bytes_per_block": row_bytes})
    spec = SpecForTier(config)
    if kind == "fs":
        tier_config: dict[str, Any] = {"type": "fs", "root_dir": fs_dir,
                                       "n_read_threads": 4, "n_write_threads": 4}  # fmt: skip
    else:
        load = "mget" if kind == "kvstrata-mget" else "auto"
        tier_config = {"type": "KvstrataTier", "module_path": "kvstrata.clients.vllm",
                       "url": f"redis://127.0.0.1:{port}", "load": load}  # fmt: skip
    return SecondaryTierFactory.create_secondary_tier(tier_config, memoryview(buffer), spec)


def run_job(tier: Any, job_id: int, keys: list[Any], rows: list[int], load: bool) -> float:
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    ctx = ReqContext(f"bench{job_id}")
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, (i + 1) * 16)
    job = TransferJob(job_id, keys, np.array(rows, dtype=np.int32), load, ctx)
    t0 = time.perf_counter()
    (tier.submit_load if load else tier.submit_store)(job)
    while True:
        done = list(tier.get_finished_jobs())
        if done:
            assert done[0].job_id == job_id and done[0].success, done
            return time.perf_counter() - t0
        time.sleep(0.0002)


def timed_lookup(tier: Any, keys: list[Any], req: str, finish: bool = False) -> float:
    """One request's lookup of ``keys`` as vLLM's scheduler makes it (scan, end the step,
    scan again until no RETRY); ``finish``: the request then finishes (``on_request_finished``),
    so what a tier remembers per request goes with it."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    ctx = ReqContext(req)
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, (i + 1) * 16)
    t0 = time.perf_counter()
    while True:
        results = [tier.lookup(k, ctx) for k in keys]
        if LookupResult.RETRY not in results:
            took = time.perf_counter() - t0
            assert all(r is LookupResult.HIT for r in results), "lookup missed"
            if finish:
                tier.on_request_finished(ctx)
            return took
        tier.on_schedule_end(END)
        time.sleep(0.0001)


def median_best(fn: Callable[[int], float], repeat: int, warmup: int = 1) -> tuple[float, float]:
    for _ in range(warmup):
        fn(-1)
    times = [fn(i) for i in range(repeat)]
    return statistics.median(times), min(times)


def bench_tier(kind: str, args: argparse.Namespace, port: int, fs_dir: str) -> dict[str, Any]:
    row_bytes, rows = args.row_mib * MiB, args.rows
    buffer = page_aligned(2 * rows, row_bytes)
    buffer[:rows] = np.random.default_rng(0).integers(-128, 128, (rows, row_bytes), np.int8)
    tier = make_tier(kind, buffer, row_bytes, port, fs_dir)
    job = iter(range(1, 1_000_000))
    out: dict[str, Any] = {"tier": kind}
    try:
        salt = iter(range(1_000_000))

        def store(_: int) -> float:  # fresh keys each time: a real write
            keys = chain_keys(rows, b"%s-%d" % (kind.encode(), next(salt)))
            return run_job(tier, next(job), keys, list(range(rows)), load=False)

        stored = chain_keys(rows, kind.encode() + b"-load")
        run_job(tier, next(job), stored, list(range(rows)), load=False)

        def load(_: int) -> float:
            return run_job(tier, next(job), stored, list(range(rows, 2 * rows)), load=True)

        nbytes = rows * row_bytes
        for name, fn in (("load", load), ("store", store)):  # loads first: stores evict
            # warm-up: stores enough to cycle through the kvstrata arena (4 jobs' worth) twice,
            # so both processes have faulted its pages in, as in a long-running engine
            med, best = median_best(fn, args.repeat, warmup=1 if name == "load" else 8)
            out[name] = (nbytes / med / 1e9, nbytes / best / 1e9)
        assert np.array_equal(buffer[rows:], buffer[:rows]), "loaded bytes differ"
    finally:
        tier.shutdown()
    out.update(bench_lookup(kind, args, port, fs_dir))
    return out


def bench_lookup(kind: str, args: argparse.Namespace, port: int, fs_dir: str) -> dict[str, Any]:
    """A 500-chunk prefix, stored with 4 KiB rows (a lookup does not read the bytes)."""
    from vllm.v1.kv_offload.base import ReqContext

    row_bytes = 4096
    buffer = page_aligned(500, row_bytes)
    tier = make_tier(kind, buffer, row_bytes, port, fs_dir)
    out: dict[str, Any] = {}
    try:
        prefix = chain_keys(500, kind.encode() + b"-prefix")
        run_job(tier, 1, prefix, list(range(500)), load=False)
        lookups = [timed_lookup(tier, prefix, f"lk{i}") for i in range(args.repeat)]
        out["lookup_ms"] = (statistics.median(lookups) * 1e3, min(lookups) * 1e3)
        for i in range(args.repeat):  # the requests end: the tiers forget their verdicts
            tier.on_request_finished(ReqContext(f"lk{i}"))
        cold = []
        for i in range(args.repeat):
            if kind.startswith("kvstrata"):
                tier._hits.clear()
            cold.append(timed_lookup(tier, prefix, f"cold{i}", finish=True))
        out["cold_ms"] = (statistics.median(cold) * 1e3, min(cold) * 1e3)
        if kind.startswith("kvstrata"):
            with Client(port=port) as kv:
                ns = tier.namespace
                t0 = time.perf_counter()
                assert kv.match(ns, prefix) == 500
                out["match_ms"] = (time.perf_counter() - t0) * 1e3
                t0 = time.perf_counter()
                for k in prefix:
                    kv.match(ns, [k])
                out["per_block_ms"] = (time.perf_counter() - t0) * 1e3
    finally:
        tier.shutdown()
    return out


def memcpy_gbps(row_bytes: int, rows: int, repeat: int) -> tuple[float, float]:
    src = np.random.default_rng(1).integers(0, 256, rows * row_bytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)

    def once(_: int) -> float:
        t0 = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - t0

    med, best = median_best(once, repeat)
    return src.nbytes / med / 1e9, src.nbytes / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--row-mib", type=int, default=2, help="vLLM chunk (primary row) size")
    ap.add_argument("--rows", type=int, default=16, help="chunks per job")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--fs-dir", default=None, help="folder for the fs tier (default: a temp dir)")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        dram = max(64 * MiB, 4 * args.rows * args.row_mib * MiB)
        for kind in ("kvstrata", "kvstrata-mget", "fs"):  # a fresh server for each
            srv = start_process_server(Path(tmp) / kind, dram_capacity=str(dram),
                                       nvme_capacity="0")  # fmt: skip
            try:
                results.append(bench_tier(kind, args, srv.port, args.fs_dir or f"{tmp}/fs"))
            finally:
                srv.stop()
    copy = memcpy_gbps(args.row_mib * MiB, args.rows, args.repeat)
    print(f"\n{args.rows} chunks of {args.row_mib} MiB per job; median (best) of {args.repeat}")
    print(f"{'tier':<16}{'store GB/s':>18}{'load GB/s':>18}{'500-chunk lookup ms':>24}")
    for r in results:
        s, ld, lk = r["store"], r["load"], r["lookup_ms"]
        print(f"{r['tier']:<16}{s[0]:>10.2f} ({s[1]:.2f}){ld[0]:>10.2f} ({ld[1]:.2f})"
              f"{lk[0]:>16.2f} ({lk[1]:.2f})")  # fmt: skip
    print(f"{'np.copyto':<16}{copy[0]:>10.2f} ({copy[1]:.2f}){copy[0]:>10.2f} ({copy[1]:.2f})")
    for r in results:
        cold = r["cold_ms"]
        print(f"{r['tier'] + ' cold':<16}{'':>36}{cold[0]:>16.2f} ({cold[1]:.2f})")
    fs = next(r for r in results if r["tier"] == "fs")
    print("lookup / fs lookup (medians): "
          + ", ".join(f"{r['tier']} {r['lookup_ms'][0] / fs['lookup_ms'][0]:.2f}"
                      for r in results if r is not fs))  # fmt: skip
    print("cold / fs lookup (medians): "
          + ", ".join(f"{r['tier']} {r['cold_ms'][0] / fs['lookup_ms'][0]:.2f}"
                      for r in results if r is not fs)
          + "; cold / fs cold: "
          + ", ".join(f"{r['tier']} {r['cold_ms'][0] / fs['cold_ms'][0]:.2f}"
                      for r in results if r is not fs))  # fmt: skip
    kv = results[0]
    print(f"\nKV.MATCH of 500 keys, one round trip: {kv['match_ms']:.2f} ms; "
          f"500 single-key round trips: {kv['per_block_ms']:.2f} ms")


if __name__ == "__main__":
    main()
