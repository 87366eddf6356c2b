"""Cost of one call of the compiled small-command path (kvstrata.server._fastpath), in process.

Each test calls ``FastPath.run`` on a buffer holding one command, as an unpipelined client's
read does, against the stores of a fake server (tests/fakectx.py): PING, GET of a present key,
SET replacing a key with a value of the same size, SET of a new key (then deleted, untimed).
ns per call is the best of ``--rounds``. ``--compare CHECKOUT`` runs the same script on
another checkout (its ``PYTHONPATH``, its built extension) in alternating rounds and prints it
beside this one. No socket and no kernel time: the C routine's own work on Python objects.

    python bench/bench_fastpath_call.py [--calls 200000] [--rounds 3] [--compare CHECKOUT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TESTS = ("PING", "GET", "SET same size", "SET new key")


def cmd(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%b\r\n" % (len(a), a) for a in args)


def measure(calls: int) -> dict[str, float]:
    """ns per call of each test, one round, on the checkout this process imports."""
    from kvstrata.server import fastpath
    from tests.fakectx import FakeServer

    srv = FakeServer()
    fast = fastpath.bind(srv)  # type: ignore[arg-type]
    if fast is None:
        raise SystemExit("kvstrata.server._fastpath is not built (python3 setup.py build_ext)")
    key = b"key:000000000001"
    bufs = {
        "PING": [cmd(b"PING")],
        "GET": [cmd(b"GET", key)],
        "SET same size": [cmd(b"SET", key, b"xxx")],
        "SET new key": [cmd(b"SET", b"new:%d" % i, b"xxx") for i in range(calls)],
    }
    out: list[bytes] = []
    first = bufs["SET same size"][0]
    if fast.run(first, 0, len(first), out, False, 1 << 29, 1 << 20, 10.0, 1 << 18)[1] != 1:
        raise SystemExit("the compiled path did not run SET")
    result = {}
    for name in TESTS:
        batch = bufs[name] if len(bufs[name]) > 1 else bufs[name] * calls
        started = time.perf_counter()
        for buf in batch:
            out.clear()
            fast.run(buf, 0, len(buf), out, False, 1 << 29, 1 << 20, 10.0, 1 << 18)
        result[name] = (time.perf_counter() - started) / calls * 1e9
    for i in range(calls):
        srv.keyspace.delete(b"new:%d" % i)
    return result


def one_round(checkout: Path, calls: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    args = [sys.executable, __file__, "--child", "--calls", str(calls)]
    got = subprocess.run(args, env=env, cwd=checkout, capture_output=True, text=True, check=True)
    data: dict[str, float] = json.loads(got.stdout)
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compare", metavar="CHECKOUT", help="also the fast path of another checkout")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.child:
        print(json.dumps(measure(opts.calls)))
        return
    sides = {"kvstrata": Path(__file__).resolve().parent.parent}
    if opts.compare:
        sides["checkout"] = Path(opts.compare).resolve()
    best: dict[str, dict[str, Any]] = {side: {} for side in sides}
    for r in range(opts.rounds):
        for side in sides if r % 2 == 0 else reversed(list(sides)):
            for name, ns in one_round(sides[side], opts.calls).items():
                best[side][name] = min(ns, best[side].get(name, ns))
    head = f"{'ns per FastPath.run call':26}" + "".join(f"{s:>12}" for s in sides)
    print(head + ("       ratio" if opts.compare else ""))
    for name in TESTS:
        row = f"{name:26}" + "".join(f"{best[s][name]:12.0f}" for s in sides)
        if opts.compare:
            row += f"{best['kvstrata'][name] / best['checkout'][name]:12.2f}"
        print(row)


if __name__ == "__main__":
    main()
