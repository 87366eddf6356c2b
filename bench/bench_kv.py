"""KV core benchmarks, each beside its peer measured in the same run (issue 3):

1. KV.PUT / KV.GET of 1, 8 and 32 MiB over TCP vs redis-server SET / GET of the same bytes and
   the loopback socket limit (one process sending with ``sendall``, the other ``recv_into``).
   Both servers are driven by the same minimal client (header + payload with ``sendmsg``, reply
   received into a preallocated buffer), so the figures compare the servers.
2. A zero-copy lease read into a numpy buffer vs memcpy (``np.copyto``) of the same bytes.
3. KV.MATCH of a 500-chunk chain in one round trip vs 500 EXISTS round trips to redis-server.

Targets (DESIGN.md): GET ≥ 2× redis and ≥ 0.8× loopback; PUT ≥ 1.5× redis; lease ≥ 0.7× memcpy;
MATCH ≥ 20×.

    python bench/bench_kv.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _servers import Proc, free_port, kvstrata_server, redis_server, timed

from kvstrata.clients import Client

NS = "bench@u8@c256"
MiB = 1 << 20


class RawClient:
    """The smallest RESP client: commands out with sendmsg, bulk replies into a buffer."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.hdr = bytearray(64)

    def command(self, *args: bytes | memoryview) -> None:
        parts: list[bytes | memoryview] = [b"*%d\r\n" % len(args)]
        for a in args:
            parts += [b"$%d\r\n" % len(a), a, b"\r\n"]
        total = sum(len(p) for p in parts)
        sent = self.sock.sendmsg(parts)
        if sent < total:  # finish the rest in order
            flat = memoryview(b"".join(bytes(p) for p in parts))[sent:]
            self.sock.sendall(flat)

    def read_line(self) -> bytes:
        line = b""
        while not line.endswith(b"\r\n"):
            line += self.sock.recv(1)
        return line

    def read_bulk_into(self, out: memoryview) -> int:
        line = self.read_line()
        n = int(line[1:-2])
        got = 0
        while got < n:
            got += self.sock.recv_into(out[got:n])
        crlf = self.sock.recv(2)
        while len(crlf) < 2:
            crlf += self.sock.recv(2 - len(crlf))
        return n


def _sender(port: int, size: int, rounds: int) -> None:
    srv = socket.create_server(("127.0.0.1", port))
    conn, _ = srv.accept()
    data = bytes(size)
    for _ in range(rounds):
        conn.recv(1)
        conn.sendall(data)
    conn.close()


def loopback_gbps(size: int, rounds: int) -> float:
    port = free_port()
    proc = mp.get_context("spawn").Process(target=_sender, args=(port, size, rounds + 1))
    proc.start()
    deadline = time.monotonic() + 30
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", port))
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    out = memoryview(bytearray(size))
    times = []
    for i in range(rounds + 1):
        t = time.perf_counter()
        sock.sendall(b"x")
        got = 0
        while got < size:
            got += sock.recv_into(out[got:])
        if i:
            times.append(time.perf_counter() - t)
    sock.close()
    proc.join()
    return size / statistics.median(times) / 1e9


def alternate(fns: list[Callable[[], object]], rounds: int) -> list[float]:
    """Median seconds of each function, called in turn round after round, so that every
    contender sees the same machine state (these VMs drift a lot from second to second)."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t)
    return [statistics.median(t) for t in times]


def cpu_per_op(proc: Proc, fn: Callable[[], object], rounds: int) -> float:
    """Server CPU milliseconds per call of ``fn`` (user + system, from /proc)."""
    before = proc.cpu_seconds()
    for _ in range(rounds):
        fn()
    return (proc.cpu_seconds() - before) * 1e3 / rounds


def bench_put_get(kv_proc: Proc, redis_proc: Proc, rounds: int) -> list[tuple]:
    kv, rd = RawClient(kv_proc.port), RawClient(redis_proc.port)
    return [_put_get(kv, rd, kv_proc, redis_proc, mib, rounds) for mib in (1, 8, 32)]


def _put_get(
    kv: RawClient, rd: RawClient, kv_proc: Proc, redis_proc: Proc, mib: int, rounds: int
) -> tuple:
    size = mib * MiB
    payload = memoryview(os.urandom(size))
    out = memoryview(bytearray(size))
    key = b"k%d" % mib
    h = b"h%d" % mib
    fresh = iter(range(10**9))

    def kv_put() -> None:
        # a new chunk each time, as an engine stores new prefixes (KV.GET reads ``h``)
        kv.command(b"KV.PUT", NS.encode(), b"%s-%d" % (h, next(fresh)), b"", payload)
        kv.read_line()

    def rd_put() -> None:
        rd.command(b"SET", key, payload)
        rd.read_line()

    def kv_get() -> None:
        kv.command(b"KV.GET", NS.encode(), h)
        kv.read_bulk_into(out)

    def rd_get() -> None:
        rd.command(b"GET", key)
        rd.read_bulk_into(out)

    kv.command(b"KV.PUT", NS.encode(), h, b"", payload)
    kv.read_line()
    t_kput, t_rput = alternate([kv_put, rd_put], rounds)
    t_kget, t_rget = alternate([kv_get, rd_get], rounds)
    assert bytes(out) == bytes(payload)
    loop = loopback_gbps(size, rounds)
    cpu = [
        cpu_per_op(p, f, rounds)
        for p, f in (
            (kv_proc, kv_put),
            (redis_proc, rd_put),
            (kv_proc, kv_get),
            (redis_proc, rd_get),
        )
    ]
    return (mib, size / t_kput / 1e9, size / t_rput / 1e9, size / t_kget / 1e9,
            size / t_rget / 1e9, loop, cpu)  # fmt: skip


def bench_lease(kv_port: int, rounds: int) -> list[tuple]:
    with Client(port=kv_port) as client:
        return [_lease(client, mib, rounds) for mib in (1, 8, 32)]


def _lease(client: Client, mib: int, rounds: int) -> tuple:
    size = mib * MiB
    h = b"lease%d" % mib
    client.put(NS, h, None, os.urandom(size))
    dst = np.empty(size, np.uint8)
    src = np.random.randint(0, 255, size, dtype=np.uint8)
    lease = client.lease(NS, [h])
    assert lease is not None
    view = lease.arrays()[0]
    t_lease = timed(lambda: np.copyto(dst, view), rounds)
    t_mem = timed(lambda: np.copyto(dst, src), rounds)
    lease.release()

    def full() -> None:
        # the engine's whole path: lease round trip, copy, release round trip
        grant = client.lease(NS, [h])
        assert grant is not None
        with grant as le:
            np.copyto(dst, le.arrays()[0])

    t_full = timed(full, rounds)
    return (mib, size / t_lease / 1e9, size / t_full / 1e9, size / t_mem / 1e9)


def bench_match(kv_port: int, redis_port: int, rounds: int) -> tuple[float, float, int]:
    import redis

    from kvstrata.store.hashing import chunk_hashes

    hashes = chunk_hashes(list(range(500 * 256)), NS, 256)
    r = redis.Redis(port=redis_port)
    with Client(port=kv_port) as client:
        parent = None
        for h in hashes:
            client.put(NS, h, parent, b"x")
            parent = h
        r.mset({b"kv:" + h: b"x" for h in hashes})
        t_match = timed(lambda: client.match(NS, hashes), rounds)
        assert client.match(NS, hashes) == 500

        def exists_loop() -> None:
            for h in hashes:
                if not r.exists(b"kv:" + h):
                    break

        t_exists = timed(exists_loop, rounds)
    return t_match, t_exists, 500


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    with (
        redis_server() as redis_proc,
        kvstrata_server("--dram-capacity", "3GiB", "--nvme-capacity", "0") as kv_proc,
    ):
        put_get = bench_put_get(kv_proc, redis_proc, args.repeat)
        lease = bench_lease(kv_proc.port, args.repeat)
        t_match, t_exists, n = bench_match(kv_proc.port, redis_proc.port, args.repeat)
    print("\n1. Payloads over TCP (GB/s, median)")
    print(
        f"{'MiB':>4} {'KV.PUT':>8} {'redis SET':>10} {'PUT/SET':>8} {'KV.GET':>8} "
        f"{'redis GET':>10} {'GET/GET':>8} {'loopback':>9} {'GET/loop':>9}"
    )
    for mib, kput, rput, kget, rget, loop, _ in put_get:
        print(
            f"{mib:4d} {kput:8.2f} {rput:10.2f} {kput / rput:8.2f} {kget:8.2f} {rget:10.2f} "
            f"{kget / rget:8.2f} {loop:9.2f} {kget / loop:9.2f}"
        )
    print("\n   server CPU ms per op (user + system)")
    print(f"{'MiB':>4} {'KV.PUT':>8} {'redis SET':>10} {'KV.GET':>8} {'redis GET':>10}")
    for mib, *_, (c_kput, c_rput, c_kget, c_rget) in put_get:
        print(f"{mib:4d} {c_kput:8.2f} {c_rput:10.2f} {c_kget:8.2f} {c_rget:10.2f}")
    print("\n2. Zero-copy lease read into a numpy buffer (GB/s, median)")
    print(f"{'MiB':>4} {'lease copy':>11} {'lease+RTT':>10} {'memcpy':>8} {'lease/memcpy':>13}")
    for mib, tl, tf, tm in lease:
        print(f"{mib:4d} {tl:11.2f} {tf:10.2f} {tm:8.2f} {tl / tm:13.2f}")
    print(f"\n3. Prefix match of a {n}-chunk chain")
    print(f"   KV.MATCH (1 round trip): {t_match * 1e3:8.3f} ms")
    print(f"   {n} EXISTS round trips to redis-server: {t_exists * 1e3:8.3f} ms")
    print(f"   speed-up: {t_exists / t_match:.1f}x")


if __name__ == "__main__":
    main()
