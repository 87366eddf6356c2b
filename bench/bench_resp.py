"""redis-benchmark against redis-server and kvstrata side by side (issues 2 and 15).

Each round runs every test against every server in turn (the order alternates from round to
round); the table shows medians over the rounds: ops/s, server CPU µs per op (user + system,
read from /proc around each test) and kvstrata's CPU ratio to redis-server's; a second table
gives the user-space part alone (both servers spend about the same kernel time per request, so
this is where they differ; 10 ms ticks, hence coarser). Targets: CPU per
small op ≤ 1.5× redis-server's, with and without pipelining; 1 MiB GET throughput ≥
redis-server's. ``--python-path`` adds a kvstrata server without its compiled small-command path
(``--fast-path no``), the before/after of that path in one run; ``--compare CHECKOUT`` adds a
kvstrata server running another checkout's code (e.g. /work/main: a change's before/after in one
run, each measured beside the same redis-server).

    python bench/bench_resp.py [--requests 50000] [--clients 16] [--rounds 3] [--python-path]
                               [--compare CHECKOUT]
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import statistics
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _servers import Proc, kvstrata_server, redis_server, thread_cpu_seconds

TARGET = 1.5  # kvstrata CPU per small op / redis-server's


def user_seconds(proc: Proc) -> float:
    """User-space CPU time of all the server's threads (/proc/PID/task/*/stat, 10 ms ticks)."""
    ticks = 0
    for task in Path(f"/proc/{proc.process.pid}/task").iterdir():
        try:
            ticks += int((task / "stat").read_text().rsplit(")", 1)[1].split()[11])
        except (OSError, ValueError, IndexError):
            continue
    return ticks / os.sysconf("SC_CLK_TCK")


def run_benchmark(
    proc: Proc, tests: str, n: int, clients: int, pipeline: int, size: int
) -> dict[str, tuple[float, float, float]]:
    """{test: (ops/s, server CPU µs per op, its user part)} — measured around each test."""
    results = {}
    for test in tests.split(","):
        before, user = thread_cpu_seconds(proc), user_seconds(proc)
        out = subprocess.run(
            ["redis-benchmark", "-p", str(proc.port), "-t", test, "-n", str(n), "-c",
             str(clients), "-P", str(pipeline), "-d", str(size), "-r", "1000", "--csv", "-q"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        cpu, user = thread_cpu_seconds(proc) - before, user_seconds(proc) - user
        for row in csv.reader(io.StringIO(out)):
            if row and row[0] != "test":
                results[row[0]] = (float(row[1]), cpu * 1e6 / n, user * 1e6 / n)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=50_000)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--python-path", action="store_true", help="also kvstrata without C path")
    ap.add_argument("--compare", metavar="CHECKOUT", help="also kvstrata from another checkout")
    args = ap.parse_args()
    n, c = args.requests, args.clients
    scenarios = [
        ("small, no pipeline", "ping_inline,ping_mbulk,set,get", n // 2, 1, 3),
        ("small, -P 16", "ping_inline,ping_mbulk,set,get", n * 4, 16, 3),
        ("1 MiB values", "set,get", max(200, n // 200), 1, 1 << 20),
    ]
    samples: dict[tuple[str, str, str], list[tuple[float, float, float]]] = {}
    with ExitStack() as stack:
        servers = [stack.enter_context(redis_server())]
        servers.append(stack.enter_context(kvstrata_server("--dram-capacity", "256MiB")))
        names = ["redis", "kvstrata"]
        if args.python_path:
            python = kvstrata_server("--dram-capacity", "256MiB", "--fast-path", "no")
            servers.append(stack.enter_context(python))
            names.append("kvstrata-py")
        if args.compare:
            other = kvstrata_server("--dram-capacity", "256MiB", checkout=args.compare)
            servers.append(stack.enter_context(other))
            names.append("checkout")
        for rnd in range(args.rounds):
            for label, tests, requests, pipeline, size in scenarios:
                order = list(zip(names, servers, strict=True))
                for name, proc in order[rnd % 2 :] + order[: rnd % 2]:
                    for test, result in run_benchmark(
                        proc, tests, requests, c, pipeline, size
                    ).items():
                        samples.setdefault((label, test, name), []).append(result)
    report(scenarios, names, samples)


def report(
    scenarios: list[tuple[str, str, int, int, int]],
    names: list[str],
    samples: dict[tuple[str, str, str], list[tuple[float, float, float]]],
) -> None:
    head = f"{'scenario':20} {'test':12}"
    for name in names:
        head += f" {name + ' ops/s':>17} {name + ' µs/op':>17}"
    print(head + "".join(f" {n + '/redis':>17}" for n in names[1:]) + "  target")
    for label, *_ in scenarios:
        tests = sorted({t for (lb, t, _) in samples if lb == label}, key=_test_order)
        for test in tests:
            med = {
                name: (
                    statistics.median(s[0] for s in samples[(label, test, name)]),
                    statistics.median(s[1] for s in samples[(label, test, name)]),
                )
                for name in names
                if (label, test, name) in samples
            }
            line = f"{label:20} {test:12}"
            for name in names:
                ops, cpu = med.get(name, (0.0, 0.0))
                line += f" {ops:17,.0f} {cpu:17.2f}"
            base = med["redis"][1]
            ratios = [med[n][1] / base if base and n in med else 0.0 for n in names[1:]]
            line += "".join(f" {r:17.2f}" for r in ratios)
            if label.startswith("small"):
                line += "  ok" if ratios[0] <= TARGET else f"  MISSED (≤ {TARGET}×)"
            print(line)
    print(f"\n{'user-space CPU µs/op':33}" + "".join(f" {n:>17}" for n in names))
    for label, test, _ in dict.fromkeys((lb, t, "") for (lb, t, _) in samples):
        line = f"{label:20} {test:12}"
        for name in names:
            runs = samples.get((label, test, name), [])
            line += f" {statistics.median(s[2] for s in runs) if runs else 0.0:17.2f}"
        print(line)


def _test_order(test: str) -> int:
    order = ["PING_INLINE", "PING_MBULK", "SET", "GET"]
    return order.index(test) if test in order else len(order)


if __name__ == "__main__":
    main()
