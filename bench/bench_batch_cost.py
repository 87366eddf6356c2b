"""The store's bookkeeping per chunk of a batched zero-copy put: µs per chunk of ``KV.MRESERVE``
(the store's ``reserve_batch``) and of ``KV.COMMIT … DIGEST`` of the whole batch, in process,
no bytes copied (the writer's digests are adopted unverified; the chunks are deleted unread).

This is the server-side part of ``bench_shm.py``'s batch put that is not a copy; it is CPU-bound
and runs in one process, so it is far steadier than the end-to-end bench on a loaded machine.
``--compare PATH`` runs the same measurement with another checkout's code (``PYTHONPATH=PATH``),
alternated run by run, and prints both::

    PYTHONPATH=$PWD python3 bench/bench_batch_cost.py --compare /work/main [--runs 3]

Per chunk size (1 MiB × 64, 8 MiB × 8, 32 MiB × 4): the median and the minimum over rounds, of
the measuring thread's on-CPU time (``--wall``: of wall time, which preemption inflates).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

MiB = 1024 * 1024
NS = "bench-batch@f16@c256"
PLAN = ((1, 64), (8, 8), (32, 4))
#: on-CPU time of the measuring thread by default (``--wall``: wall time): on a machine shared
#: with other jobs, preemption inflates wall times by whatever else runs meanwhile
CLOCK = time.perf_counter if "--wall" in sys.argv else time.thread_time


async def measure(rounds: int) -> dict[str, list[float]]:
    from kvstrata.config import load_config
    from kvstrata.store.keyspace import Keyspace
    from kvstrata.store.kvstore import KVStore
    from kvstrata.store.kvstore.batch import BatchItem
    from kvstrata.store.leases import Holder

    flags = {"dram-capacity": "1GiB", "nvme-capacity": "0", "dram-pin": "no"}
    store = await KVStore.from_config(load_config(flags=flags, env={}), Keyspace())
    await store.start()
    holder = Holder(1)
    out: dict[str, list[float]] = {}
    try:
        for mib, n in PLAN:
            res_t, com_t = [], []
            for r in range(rounds + 3):  # three warm-up rounds
                items = [BatchItem(b"%d-%d-%d" % (mib, r, i), mib * MiB) for i in range(n)]
                t0 = CLOCK()
                got = await store.reserve_batch(NS, b"", items, 256, holder=holder)
                t1 = CLOCK()
                assert got.lease is not None
                await store.commit(got.lease.id, range(n), holder, [b"\x07" * 16] * n)
                t2 = CLOCK()
                if r >= 3:
                    res_t.append((t1 - t0) / n * 1e6)
                    com_t.append((t2 - t1) / n * 1e6)
                for item in items:
                    await store.delete(NS, item.hash)
                await store.drain()
            out[f"{mib}:reserve"], out[f"{mib}:commit"] = res_t, com_t
    finally:
        await store.close()
    return out


def run_checkout(path: str, rounds: int) -> dict[str, list[float]]:
    env = {**os.environ, "PYTHONPATH": path}
    argv = [sys.executable, __file__, "--json", "--rounds", str(rounds)]
    argv += ["--wall"] if CLOCK is time.perf_counter else []
    done = subprocess.run(argv, env=env, cwd=path, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=35)
    ap.add_argument("--runs", type=int, default=1, help="alternated runs per side (--compare)")
    ap.add_argument("--compare", help="another checkout, measured alternately")
    ap.add_argument("--wall", action="store_true", help="wall time instead of on-CPU time")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.json:
        print(json.dumps(asyncio.run(measure(args.rounds))))
        return
    here = os.environ.get("PYTHONPATH") or os.getcwd()
    sides = {"this": here} if args.compare is None else {"compare": args.compare, "this": here}
    got: dict[str, dict[str, list[float]]] = {name: {} for name in sides}
    for _ in range(args.runs):
        for name, path in sides.items():
            for key, values in run_checkout(path, args.rounds).items():
                got[name].setdefault(key, []).extend(values)
    clock = "wall" if args.wall else "on-CPU"
    print(f"{clock} µs per chunk, median (min) over {args.rounds} rounds x {args.runs} runs")
    head = f"{'chunks':>10}"
    for name in sides:
        head += f" {name + ' MRESERVE':>20} {name + ' COMMIT':>18}"
    print(head)
    for mib, n in PLAN:
        row = f"{f'{n} x {mib} MiB':>10}"
        for name in sides:
            for op, width in (("reserve", 20), ("commit", 18)):
                v: Any = got[name][f"{mib}:{op}"]
                row += f" {f'{statistics.median(v):.1f} ({min(v):.1f})':>{width}}"
        print(row)


if __name__ == "__main__":
    main()
