"""What a user runs: ``redis-benchmark`` against kvstrata and redis-server, alternately (issue 31).

Cells: ``-c 1`` and ``-c 50`` clients × ``-P 1`` and ``-P 16`` pipelining × three tests:
``GET`` and ``SET`` (``-t get``/``-t set``, 3-byte values over ``-r 1000`` keys) and a chain
lookup of :data:`CHAIN` chunks through redis-benchmark's argument form — ``KV.MATCH ns h1 … h8``
on kvstrata (a chain stored beforehand, all in DRAM), ``EXISTS k1 … k8`` on redis-server (its
nearest command: the same number of keys looked up in one round trip). Each round runs every
cell on every server in turn (the order alternates from round to round); a cell's figure is the
median over the rounds of kvstrata's rps ÷ redis-server's (and p50, p99 latency ratios) measured
in the same round, so a loaded machine moves both sides together; ``cpu×`` is the server's CPU
per request (all its threads, from /proc) beside redis-server's, the figure a loaded machine
disturbs least. ``--compare CHECKOUT`` adds
kvstrata running another checkout's code (e.g. /work/main: before/after in one run).

Targets: rps ≥ 0.9× redis-server's and p50 ≤ 1.3× in every cell.

    python bench/bench_redis_benchmark.py [--requests 40000] [--rounds 3] [--compare CHECKOUT]
                                          [--clients 1,50] [--pipeline 1,16]
"""

from __future__ import annotations

import argparse
import csv
import io
import statistics
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _servers import Proc, kvstrata_server, redis_server, thread_cpu_seconds

RPS_TARGET = 0.9
P50_TARGET = 1.3
CHAIN = 8
NS = "bench@c16"
TESTS = ("GET", "SET", "MATCH")


def chain() -> list[bytes]:
    return [b"h%02d" % i for i in range(CHAIN)]


def prepare(name: str, proc: Proc) -> None:
    """The chain KV.MATCH (or EXISTS) looks up, stored once."""
    r = redis.Redis(port=proc.port)
    parent = b""
    for h in chain():
        if name == "redis":
            r.set(b"k" + h, b"x" * 16)
        else:
            r.execute_command("KV.PUT", NS, h, parent, b"x" * 4096)
            parent = h
    if name != "redis":
        assert r.execute_command("KV.MATCH", NS, *chain()) == CHAIN, "chain not stored"
    r.close()


def command_of(name: str, test: str) -> list[str]:
    if test != "MATCH":
        return ["-t", test.lower(), "-r", "1000"]
    if name == "redis":
        return ["EXISTS", *(("k" + h.decode()) for h in chain())]
    return ["KV.MATCH", NS, *(h.decode() for h in chain())]


Sample = tuple[float, float, float, float]  # rps, p50 ms, p99 ms, server CPU µs per request


def run_cell(name: str, proc: Proc, test: str, n: int, clients: int, pipeline: int) -> Sample:
    """One redis-benchmark run and the server CPU it cost."""
    before = thread_cpu_seconds(proc)
    out = subprocess.run(
        ["redis-benchmark", "-p", str(proc.port), "-n", str(n), "-c", str(clients),
         "-P", str(pipeline), "--csv", *command_of(name, test)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    cpu = (thread_cpu_seconds(proc) - before) * 1e6 / n
    rows = [row for row in csv.reader(io.StringIO(out)) if row and row[0] != "test"]
    if len(rows) != 1:
        raise RuntimeError(f"unexpected redis-benchmark output:\n{out}")
    row = rows[0]
    return float(row[1]), float(row[4]), float(row[6]), cpu


Cell = tuple[str, int, int]  # test, clients, pipeline


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=40_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", default="1,50")
    ap.add_argument("--pipeline", default="1,16")
    ap.add_argument("--tests", default=",".join(TESTS))
    ap.add_argument("--compare", metavar="CHECKOUT", help="also kvstrata from another checkout")
    args = ap.parse_args()
    cells: list[Cell] = [
        (t, int(c), int(p))
        for c in args.clients.split(",")
        for p in args.pipeline.split(",")
        for t in args.tests.split(",")
    ]
    samples: dict[tuple[Cell, str], list[Sample]] = {}
    with ExitStack() as stack:
        servers = [("redis", stack.enter_context(redis_server()))]
        servers.append(("kvstrata", stack.enter_context(kvstrata_server(*_KV_ARGS))))
        if args.compare:
            other = kvstrata_server(*_KV_ARGS, checkout=args.compare)
            servers.append(("checkout", stack.enter_context(other)))
        for name, proc in servers:
            prepare(name, proc)
            for cell in cells:  # warm-up (a fresh server may still be touching its arena)
                run_cell(name, proc, cell[0], max(1000, args.requests // 10), cell[1], cell[2])
        for rnd in range(args.rounds):
            for cell in cells:
                k = rnd % len(servers)  # each server first in turn
                order = servers[k:] + servers[:k]
                for name, proc in order:
                    samples.setdefault((cell, name), []).append(
                        run_cell(name, proc, cell[0], args.requests, cell[1], cell[2])
                    )
    report(cells, [name for name, _ in servers], samples)


_KV_ARGS = ("--dram-capacity", "256MiB")


def report(
    cells: list[Cell],
    names: list[str],
    samples: dict[tuple[Cell, str], list[Sample]],
) -> None:
    head = f"{'cell':22}" + "".join(f" {n + ' rps':>15} {n + ' p50':>13}" for n in names)
    for n in names[1:]:
        head += f" {n + '/redis rps':>20} {'p50×':>6} {'p99×':>6} {'cpu×':>6}"
    print(head + "  target")
    missed = 0
    for cell in cells:
        test, clients, pipeline = cell
        line = f"{test + f' -c {clients} -P {pipeline}':22}"
        for n in names:
            runs = samples[(cell, n)]
            line += f" {statistics.median(r[0] for r in runs):15,.0f}"
            line += f" {statistics.median(r[1] for r in runs):11.3f}ms"
        base = samples[(cell, "redis")]
        verdict = ""
        for n in names[1:]:
            runs = samples[(cell, n)]
            # per round, beside redis-server's figure of the same round; then the median
            rps = statistics.median(r[0] / b[0] for r, b in zip(runs, base, strict=True))
            p50 = statistics.median(r[1] / max(b[1], 1e-3) for r, b in zip(runs, base, strict=True))
            p99 = statistics.median(r[2] / max(b[2], 1e-3) for r, b in zip(runs, base, strict=True))
            cpu = statistics.median(r[3] / max(b[3], 1e-3) for r, b in zip(runs, base, strict=True))
            line += f" {rps:20.2f} {p50:6.2f} {p99:6.2f} {cpu:6.2f}"
            if n == "kvstrata":
                ok = rps >= RPS_TARGET and p50 <= P50_TARGET
                missed += not ok
                verdict = "  ok" if ok else f"  MISSED (≥ {RPS_TARGET}× rps, p50 ≤ {P50_TARGET}×)"
        print(line + verdict)
    print(f"\n{len(cells) - missed} of {len(cells)} cells meet the targets")
    print("cpu×: server CPU per request (all threads, schedstat) ÷ redis-server's, same round")
    print("\nserver CPU µs per request (median)" + "".join(f" {n:>12}" for n in names))
    for cell in cells:
        test, clients, pipeline = cell
        line = f"{test + f' -c {clients} -P {pipeline}':34}"
        for n in names:
            line += f" {statistics.median(r[3] for r in samples[(cell, n)]):12.2f}"
        print(line)


if __name__ == "__main__":
    main()
