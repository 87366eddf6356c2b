"""Large payloads over loopback TCP: kvstrata vs the loopback limit and redis-server, one run.

    python bench/bench_tcp.py [--rounds 7] [--sizes 1,8,32]

For each chunk size every contender moves the same ``--batch`` bytes per call (whole chunks), and
the contenders run in turn round after round, in a shuffled order (these shared VMs drift from
second to second), so each median is taken under the same machine state as its peers:

- loopback limit: a plain socket server process; ``sendall`` of the chunk, ``recv_into`` a
  preallocated buffer on the other side (get direction), and the reverse (put direction);
- kvstrata's own client: ``pipeline().put`` of new chunks, ``get(out=)`` and ``mget(outs=)``
  into preallocated buffers;
- raw-socket ``KV.PUT`` (header + payload with ``sendmsg``; what a minimal client gets);
- redis-server ``SET``/``GET`` through redis-py;
- with ``--compare CHECKOUT``: the same kvstrata rows against a second server running another
  checkout's code (e.g. ``/work/main``), driven by this checkout's client, so a change to the
  server is measured before and after under the same machine state. Read the after/before
  ratios from such a run, and the targets from a run without it: two servers, their arenas
  and two sets of 32 MiB buffers halved every kvstrata 32 MiB GET here (1.7 against 3.3 GB/s,
  loopback 3.2 in both runs), whichever server it went to.

Targets (issue 15, DESIGN.md), at 8–32 MiB: kvstrata put/get ≥ 0.8× the loopback limit, get ≥ 2×
redis GET, put ≥ 1.5× redis SET.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import socket
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from itertools import count
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _servers import free_port, kvstrata_server, redis_server

from kvstrata.clients import Client

NS = "benchtcp@u8@c256"
MiB = 1 << 20


def _loopback_server(port: int, size: int) -> None:
    """``g``: send a chunk; ``p``: receive a chunk, answer one byte."""
    srv = socket.create_server(("127.0.0.1", port))
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = os.urandom(size)
    sink = memoryview(bytearray(size))
    while req := conn.recv(1):
        if req == b"g":
            conn.sendall(data)
            continue
        got = 0
        while got < size:
            got += conn.recv_into(sink[got:])
        conn.sendall(b"k")


class Loopback:
    """The bare socket path between two processes, in both directions."""

    def __init__(self, size: int) -> None:
        port = free_port()
        self.proc = mp.get_context("spawn").Process(target=_loopback_server, args=(port, size))
        self.proc.start()
        deadline = time.monotonic() + 30
        while True:
            try:
                self.sock = socket.create_connection(("127.0.0.1", port))
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.size = size
        self.data = os.urandom(size)
        self.out = memoryview(bytearray(size))

    def get(self) -> None:
        self.sock.sendall(b"g")
        got = 0
        while got < self.size:
            got += self.sock.recv_into(self.out[got:])

    def put(self) -> None:
        self.sock.sendall(b"p")
        self.sock.sendall(self.data)
        self.sock.recv(1)

    def close(self) -> None:
        self.sock.close()
        self.proc.join(10)


class RawPut:
    """The smallest RESP client for KV.PUT: one sendmsg of header, payload and CRLF."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def put(self, h: bytes, payload: bytes) -> None:
        args = [b"KV.PUT", NS.encode(), h, b"", payload]
        parts: list[bytes | memoryview] = [b"*%d\r\n" % len(args)]
        for a in args:
            parts += [b"$%d\r\n" % len(a), a, b"\r\n"]
        total = sum(len(p) for p in parts)
        sent = self.sock.sendmsg(parts)
        if sent < total:
            self.sock.sendall(memoryview(b"".join(parts))[sent:])
        reply = self.sock.recv(64)
        if reply != b":1\r\n":
            raise RuntimeError(f"KV.PUT failed: {reply!r}")


def alternate(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds of each function, called in turn round after round (after a warm-up).

    The order is shuffled each round (seeded): whoever runs right after a peer's large transfer
    pays for the peer's clean-up (redis-server freeing its 32 MiB reply on one of the two
    cores), and with a fixed order (or a rotation, which keeps neighbours) that was always the
    same contender, at half speed whichever it was."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    order = random.Random(15)
    for _ in range(rounds):
        order.shuffle(names)
        for name in names:
            t = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(t) for name, t in times.items()}


def kv_contenders(size: int, n: int, kv: Client, raw: RawPut, tag: str = "") -> dict:
    """kvstrata's own client (and a raw KV.PUT) against one server; ``tag`` names the server."""
    payload = os.urandom(size)
    fresh = count()
    stored = [b"g%d-%d" % (size, i) for i in range(n)]
    pipe = kv.pipeline()
    for h in stored:
        pipe.put(NS, h, None, payload)
    pipe.execute()
    outs = [bytearray(size) for _ in range(n)]
    check = kv.get(NS, stored[0], out=outs[0])
    assert bytes(check) == payload, "kvstrata returned wrong bytes"

    def kv_put() -> None:
        p = kv.pipeline()
        for _ in range(n):
            p.put(NS, b"p%d" % next(fresh), None, payload)
        p.execute()

    def kv_get() -> None:
        for h, out in zip(stored, outs, strict=True):
            kv.get(NS, h, out=out)

    def kv_mget() -> None:
        kv.mget(NS, stored, outs=outs)

    def raw_put() -> None:
        for _ in range(n):
            raw.put(b"r%d" % next(fresh), payload)

    return {
        f"{tag}kv get(out=)": kv_get, f"{tag}kv mget(outs=)": kv_mget,
        f"{tag}kv pipeline().put": kv_put, f"{tag}raw KV.PUT": raw_put,
    }  # fmt: skip


def peer_contenders(size: int, n: int, r: Any, lb: Loopback) -> dict:
    payload = os.urandom(size)
    r.set(b"blob", payload)

    def rd_set() -> None:
        for _ in range(n):
            r.set(b"blob", payload)

    def rd_get() -> None:
        for _ in range(n):
            r.get(b"blob")

    def lb_get() -> None:
        for _ in range(n):
            lb.get()

    def lb_put() -> None:
        for _ in range(n):
            lb.put()

    return {"loopback get": lb_get, "redis GET": rd_get, "loopback put": lb_put,
            "redis SET": rd_set}  # fmt: skip


def main() -> None:
    import redis

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,8,32", help="chunk sizes in MiB")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batch-mib", type=int, default=32, help="bytes moved per call")
    ap.add_argument("--compare", metavar="CHECKOUT",
                    help="also run the server of another checkout (e.g. /work/main), driven "
                         "by this checkout's client, in the same alternation")  # fmt: skip
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    results: dict[int, dict[str, float]] = {}
    flags = ("--dram-capacity", "1GiB", "--nvme-capacity", "0")
    with ExitStack() as stack:
        rproc = stack.enter_context(redis_server())
        servers = [("", stack.enter_context(kvstrata_server(*flags)))]
        if args.compare:
            before = kvstrata_server(*flags, checkout=args.compare)
            servers.append(("before: ", stack.enter_context(before)))
        clients = [
            (tag, stack.enter_context(Client(port=p.port)), RawPut(p.port)) for tag, p in servers
        ]
        r = redis.Redis(port=rproc.port)
        stack.callback(r.close)
        for mib in sizes:
            size = mib * MiB
            n = max(1, args.batch_mib // mib)
            lb = Loopback(size)
            try:
                fns = peer_contenders(size, n, r, lb)
                for tag, kv, raw in clients:
                    fns.update(kv_contenders(size, n, kv, raw, tag))
                times = alternate(fns, args.rounds)
            finally:
                lb.close()
            results[mib] = {k: n * size / t / 1e9 for k, t in times.items()}
    report(results, args)


def report(results: dict[int, dict[str, float]], args: argparse.Namespace) -> None:
    names = list(next(iter(results.values())))
    print(f"\nGB/s, median of {args.rounds} alternating rounds, {args.batch_mib} MiB per call, "
          f"{os.cpu_count()} CPUs, loopback TCP\n")  # fmt: skip
    print(f"| {'path':<26} | " + " | ".join(f"{m:>6} MiB" for m in results) + " |")
    print(f"|{'-' * 28}|" + "|".join("-" * 12 for _ in results) + "|")
    for name in names:
        print(f"| {name:<26} | " + " | ".join(f"{r[name]:10.2f}" for r in results.values()) + " |")
    ratios = [
        ("get(out=) / loopback get", "kv get(out=)", "loopback get", 0.8),
        ("mget(outs=) / loopback get", "kv mget(outs=)", "loopback get", 0.8),
        ("pipeline put / loopback put", "kv pipeline().put", "loopback put", 0.8),
        ("raw KV.PUT / loopback put", "raw KV.PUT", "loopback put", 0.8),
        ("get(out=) / redis GET", "kv get(out=)", "redis GET", 2.0),
        ("mget(outs=) / redis GET", "kv mget(outs=)", "redis GET", 2.0),
        ("pipeline put / redis SET", "kv pipeline().put", "redis SET", 1.5),
        ("raw KV.PUT / redis SET", "raw KV.PUT", "redis SET", 1.5),
    ]
    if args.compare:
        ratios += [
            (f"{name} / before", name, f"before: {name}", 0.0)
            for name in ("kv get(out=)", "kv mget(outs=)", "kv pipeline().put", "raw KV.PUT")
        ]
    print(f"\n| {'ratio (target)':<38} | " + " | ".join(f"{m:>6} MiB" for m in results) + " |")
    print(f"|{'-' * 40}|" + "|".join("-" * 12 for _ in results) + "|")
    for label, a, b, target in ratios:
        cells = []
        for r in results.values():
            x = r[a] / r[b]
            verdict = "  " if not target else "ok" if x >= target else "--"
            cells.append(f"{x:8.2f} {verdict}")
        goal = f" (>= {target})" if target else ""
        print(f"| {label + goal:<38} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
