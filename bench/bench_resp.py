"""redis-benchmark against redis-server and kvstrata side by side (issue 2's benchmark).

Prints ops/s and server CPU microseconds per op for each, and the ratios. Targets: CPU per small
op ≤ 1.5× redis-server's; 1 MiB GET throughput ≥ redis-server's.

    python bench/bench_resp.py [--requests 100000] [--clients 16]
"""

from __future__ import annotations

import argparse
import csv
import io
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _servers import Proc, kvstrata_server, redis_server


def run_benchmark(
    proc: Proc, tests: str, n: int, clients: int, pipeline: int, size: int
) -> dict[str, tuple[float, float]]:
    """{test: (ops/s, server CPU µs per op)} — CPU measured around each test separately."""
    results = {}
    for test in tests.split(","):
        before = proc.cpu_seconds()
        out = subprocess.run(
            ["redis-benchmark", "-p", str(proc.port), "-t", test, "-n", str(n), "-c",
             str(clients), "-P", str(pipeline), "-d", str(size), "-r", "1000", "--csv", "-q"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        cpu = proc.cpu_seconds() - before
        for row in csv.reader(io.StringIO(out)):
            if row and row[0] != "test":
                total = n * (2 if row[0].startswith("PING") and test == "ping" else 1)
                results[row[0]] = (float(row[1]), cpu * 1e6 / total)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--clients", type=int, default=16)
    args = ap.parse_args()
    n, c = args.requests, args.clients
    scenarios = [
        ("small, no pipeline", "ping_inline,ping_mbulk,set,get", n // 2, 1, 3),
        ("small, -P 16", "ping_inline,ping_mbulk,set,get", n * 4, 16, 3),
        ("1 MiB values", "set,get", max(200, n // 200), 1, 1 << 20),
    ]
    rows = []
    with redis_server() as redis, kvstrata_server("--dram-capacity", "256MiB") as kv:
        for label, tests, requests, pipeline, size in scenarios:
            r = run_benchmark(redis, tests, requests, c, pipeline, size)
            k = run_benchmark(kv, tests, requests, c, pipeline, size)
            for test in r:
                rows.append((label, test, r[test], k.get(test, (0.0, 0.0))))
    print(
        f"{'scenario':20} {'test':12} {'redis ops/s':>12} {'kvstrata ops/s':>15} "
        f"{'ratio':>6} {'redis µs/op':>12} {'kvstrata µs/op':>15} {'CPU ratio':>9}"
    )
    for label, test, (rops, rcpu), (kops, kcpu) in rows:
        print(
            f"{label:20} {test:12} {rops:12.0f} {kops:15.0f} {kops / rops:6.2f} "
            f"{rcpu:12.2f} {kcpu:15.2f} {kcpu / rcpu if rcpu else 0:9.2f}"
        )


if __name__ == "__main__":
    main()
