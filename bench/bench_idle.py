"""Idle CPU of a server that holds many keys with a TTL or many clients that do not read.

Issue 12: active expiry used to sort every key with a TTL every 100 ms, and every client that
did not read a zero-copy reply re-armed a 0.5 ms timer. This measures the CPU share of an idle
server process (from /proc) in three states, beside redis-server in the same states:

- ``empty``: nothing stored;
- ``ttl keys``: N keys (default 1M) with a one-hour TTL, loaded with ``redis-cli --pipe``;
- ``non-readers``: 200 clients that each requested a 4 MiB value (``KV.GET`` of a chunk for
  kvstrata, ``GET`` for redis-server) and never read the reply.

Target (issue 12): < 5% of a core in every state.

    python bench/bench_idle.py [--keys 1000000] [--seconds 5] [--clients 200] [--settle 3]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _servers import Proc, kvstrata_server, redis_server

MiB = 1024 * 1024


def _cmd(*words: bytes) -> bytes:
    return b"*%d\r\n" % len(words) + b"".join(b"$%d\r\n%b\r\n" % (len(w), w) for w in words)


def _protocol_file(keys: int) -> Path:
    """SET key:i v PX 3600000 for every key, as one file for ``redis-cli --pipe``."""
    path = Path(tempfile.gettempdir()) / f"kvstrata-bench-ttl-{keys}.resp"
    if not path.exists():
        with path.open("wb") as f:
            for start in range(0, keys, 100_000):
                f.write(b"".join(
                    _cmd(b"SET", b"key:%d" % i, b"v", b"PX", b"3600000")
                    for i in range(start, min(keys, start + 100_000))
                ))  # fmt: skip
    return path


def _pipe(proc: Proc, path: Path) -> None:
    with path.open("rb") as f:
        subprocess.run(["redis-cli", "-p", str(proc.port), "--pipe"], stdin=f, check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip


def _call(port: int, data: bytes, expect: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(data)
        got = b""
        while not got.endswith(b"\r\n"):
            got += s.recv(4096)
        assert got.startswith(expect), got[:200]


def _share(proc: Proc, seconds: float) -> float:
    """CPU share of ``proc`` over ``seconds`` of idleness."""
    cpu0, wall0 = proc.cpu_seconds(), time.monotonic()
    time.sleep(seconds)  # the measurement window: nothing else is sent meanwhile
    return (proc.cpu_seconds() - cpu0) / (time.monotonic() - wall0)


def _non_readers(port: int, request: bytes, count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", port))
        s.sendall(request)
        socks.append(s)
    return socks


def measure(proc: Proc, kv: bool, args: argparse.Namespace, path: Path) -> dict[str, float]:
    """The three states in turn: empty, non-readers (then closed), TTL keys."""
    out = {"empty": _share(proc, args.seconds)}
    value = b"c" * (4 * MiB)
    if kv:
        _call(proc.port, _cmd(b"KV.PUT", b"ns", b"h" * 32, b"", value), b":1")
        request = _cmd(b"KV.GET", b"ns", b"h" * 32)
    else:
        _call(proc.port, _cmd(b"SET", b"big", value), b"+OK")
        request = _cmd(b"GET", b"big")
    socks = _non_readers(proc.port, request, args.clients)
    try:
        time.sleep(args.settle)  # let every request be served before measuring
        out["non-readers"] = _share(proc, args.seconds)
    finally:
        for s in socks:
            s.close()
    started = time.perf_counter()
    _pipe(proc, path)
    out["load s"] = time.perf_counter() - started
    _call(proc.port, _cmd(b"DBSIZE"), b":%d" % (args.keys + 1))
    out["ttl keys"] = _share(proc, args.seconds)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument(
        "--settle",
        type=float,
        default=3.0,
        help="seconds between the non-readers' requests and the measurement",
    )
    args = parser.parse_args()
    path = _protocol_file(args.keys)
    rows: list[tuple[str, dict[str, float]]] = []
    runs: list[tuple[str, Callable[[], object], bool]] = [
        ("redis-server", redis_server, False),
        # maxmemory above what 1M small values count (0 would mean the 64 MiB DRAM capacity,
        # and allkeys-lru would evict keys while they are loaded)
        ("kvstrata", lambda: kvstrata_server("--dram-capacity", "64MiB", "--nvme-capacity",
                                             "0", "--maxmemory", "1GiB"), True),
    ]  # fmt: skip
    for name, start, kv in runs:
        with start() as proc:  # type: ignore[attr-defined]
            rows.append((name, measure(proc, kv, args, path)))
    print(f"idle CPU share of one core ({args.keys} TTL keys, {args.clients} non-readers, "
          f"{args.seconds:g} s windows)")  # fmt: skip
    print(f"{'server':<14}{'empty':>8}{'ttl keys':>10}{'non-readers':>13}{'load s':>8}")
    for name, r in rows:
        print(f"{name:<14}{r['empty']:>8.1%}{r['ttl keys']:>10.1%}{r['non-readers']:>13.1%}"
              f"{r['load s']:>8.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
