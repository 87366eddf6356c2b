"""Fenced leases (issue 10): what fencing costs the zero-copy read path, and how much arena
memory quarantined (fenced) slots hold under a lease-expiring workload.

1. Lease read throughput of 1, 8 and 32 MiB chunks, next to memcpy (``np.copyto`` of the same
   size) measured in the same run: the copy from a lease's numpy view, and the engine's whole
   path (KV.LEASE round trip + handle check + copy + KV.RELEASE). With ``--before PATH`` (a
   checkout of the code before fencing, e.g. ``git worktree add /tmp/before <commit>``) the
   same measurement also runs with server and client from that tree, so both columns come from
   one run on one machine. Target (DESIGN.md): lease copy ≥ 0.7× memcpy.
2. Fenced memory: holders lease chunks with 100 ms TTLs and keep the views past expiry
   (releasing a share of them late), while a writer keeps the 8 MiB arena under pressure;
   INFO is sampled: peak and mean bytes fenced, next to the bytes leased at the same moments
   and the arena size; then the holders disconnect and what is still fenced is reported.

    python3 bench/bench_leases.py [--before /tmp/before] [--rounds 15] [--seconds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _servers import kvstrata_server, timed

from kvstrata.clients import Client

NS = "bench-lease@u8@c16"
MiB = 1024 * 1024


def paired(view: np.ndarray, src: np.ndarray, dst: np.ndarray, rounds: int) -> tuple:
    """Copies from the lease view and memcpy of the same size, alternated round by round (a
    busy machine shifts both alike): median seconds of each and the median per-round ratio
    memcpy time / view time (= view rate / memcpy rate)."""
    np.copyto(dst, view)
    np.copyto(dst, src)
    t_view, t_mem, ratios = [], [], []
    for _ in range(rounds):
        t = time.perf_counter()
        np.copyto(dst, view)
        a = time.perf_counter() - t
        t = time.perf_counter()
        np.copyto(dst, src)
        b = time.perf_counter() - t
        t_view.append(a)
        t_mem.append(b)
        ratios.append(b / a)
    return statistics.median(t_view), statistics.median(t_mem), statistics.median(ratios)


def lease_rates(rounds: int) -> list[dict[str, float]]:
    """Section 1 in this interpreter (its PYTHONPATH picks the code measured)."""
    out = []
    flags = ("--dram-capacity", "256MiB", "--nvme-capacity", "0")
    with kvstrata_server(*flags) as srv, Client(port=srv.port) as kv:
        for mib in (1, 8, 32):
            size = mib * MiB
            h = b"lease%d" % mib
            kv.put(NS, h, None, np.random.randint(0, 255, size, dtype=np.uint8))
            dst = np.empty(size, np.uint8)
            src = np.random.randint(0, 255, size, dtype=np.uint8)
            lease = kv.lease(NS, [h])
            assert lease is not None
            view = lease.arrays()[0]
            t_view, t_mem, ratio = paired(view, src, dst, rounds)
            lease.release()

            def full() -> None:
                grant = kv.lease(NS, [h])  # noqa: B023
                assert grant is not None
                np.copyto(dst, grant.arrays()[0])  # noqa: B023
                grant.release()

            t_full = timed(full, rounds)
            out.append({"mib": mib, "view": size / t_view / 1e9, "ratio": ratio,
                        "full": size / t_full / 1e9, "memcpy": size / t_mem / 1e9})  # fmt: skip
    return out


def run_lease_rates(pythonpath: str, rounds: int) -> list[dict[str, float]]:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    cmd = [sys.executable, __file__, "--child-rates", "--rounds", str(rounds)]
    # cwd too: ``python -m kvstrata`` puts the working directory ahead of PYTHONPATH
    done = subprocess.run(cmd, env=env, cwd=pythonpath, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def holder(port: int, seconds: float, seed: int) -> None:
    """Leases with a 100 ms TTL kept past expiry; about a third released late, the rest held
    until the end (then the connection closes)."""
    rng = np.random.default_rng(seed)
    held = []
    with Client(port=port, max_connections=1) as kv:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            h = b"w%06d" % rng.integers(0, 400)
            try:
                lease = kv.lease(NS, [h], ttl_ms=100)
            except Exception:  # LEASELIMIT past lease-fence-max: release what expired
                for old in held:
                    try:
                        old.release()
                    except Exception:
                        pass
                held.clear()
                continue
            if lease is not None:
                held.append(lease)
                lease.arrays()
            if len(held) > 8 and rng.random() < 0.3:
                try:
                    held.pop(0).release()
                except Exception:
                    pass
            time.sleep(0.01)


def fenced_memory(seconds: float) -> dict[str, float]:
    """Section 2: sample INFO while holders lease and a writer applies pressure."""
    import redis

    arena = 8 * MiB
    flags = ("--dram-capacity", str(arena), "--nvme-capacity", "0", "--lease-fence-max", "2MiB")
    with kvstrata_server(*flags) as srv:
        r = redis.Redis(port=srv.port)
        stop = threading.Event()

        def writer() -> None:
            i = 0
            while not stop.is_set():
                r.execute_command("KV.PUT", NS, b"w%06d" % (i % 400), b"", b"x" * 65536)
                i += 1

        threads = [threading.Thread(target=writer)]
        threads += [threading.Thread(target=holder, args=(srv.port, seconds, s)) for s in range(4)]
        for t in threads:
            t.start()
        fenced, leased = [], []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            info = r.info("tiers")
            fenced.append(info["kv_fenced_bytes"])
            leased.append(info.get("kv_leased_bytes", 0))
            time.sleep(0.05)
        for t in threads[1:]:
            t.join()
        stop.set()
        threads[0].join()
        settle = time.monotonic() + 5
        while r.info("tiers")["kv_fenced_bytes"] and time.monotonic() < settle:
            time.sleep(0.05)
        info = r.info("tiers")
        return {
            "arena": arena, "peak_fenced": max(fenced), "mean_fenced": statistics.mean(fenced),
            "peak_leased": max(leased), "mean_leased": statistics.mean(leased),
            "fences": info["kv_fenced_total"], "after": info["kv_fenced_bytes"],
        }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", help="checkout of the code before fencing (PYTHONPATH)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--child-rates", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_rates:
        print(json.dumps(lease_rates(args.rounds)))
        return
    here = str(Path(__file__).resolve().parent.parent)
    after = run_lease_rates(here, args.rounds)
    before = run_lease_rates(args.before, args.rounds) if args.before else None
    print("1. Lease read into numpy (GB/s, medians; view/memcpy: median of per-round ratios of")
    print("   alternated copies); 'full' = lease + copy + release round trips")
    head = f"{'MiB':>4} {'memcpy':>8} {'view':>8} {'full':>8} {'view/memcpy':>12}"
    if before:
        head += f" {'before view':>12} {'before full':>12} {'memcpy (b)':>11} {'ratio (b)':>10}"
    print(head)
    for i, row in enumerate(after):
        line = (f"{row['mib']:>4} {row['memcpy']:>8.2f} {row['view']:>8.2f} {row['full']:>8.2f}"
                f" {row['ratio']:>12.2f}")  # fmt: skip
        if before:
            b = before[i]
            line += f" {b['view']:>12.2f} {b['full']:>12.2f} {b['memcpy']:>11.2f}"
            line += f" {b['ratio']:>10.2f}"
        print(line)
    m = fenced_memory(args.seconds)
    print("\n2. Arena memory held by fenced (quarantined) slots: 4 holders, 100 ms TTLs, 8 MiB")
    print(f"{'':<22}{'peak MiB':>10}{'mean MiB':>10}")
    print(f"{'fenced (expired)':<22}{m['peak_fenced'] / MiB:>10.2f}{m['mean_fenced'] / MiB:>10.2f}")
    print(f"{'leased (live)':<22}{m['peak_leased'] / MiB:>10.2f}{m['mean_leased'] / MiB:>10.2f}")
    print(f"{'arena':<22}{m['arena'] / MiB:>10.2f}")
    print(f"fences made: {m['fences']}; fenced after the holders disconnected: {m['after']} B")


if __name__ == "__main__":
    main()
