"""Load of one large chunk into a preallocated tensor: kvstrata client vs redis-py vs loopback.

    python bench/bench_client.py                 # starts `kvstrata serve` and redis-server
    python bench/bench_client.py --port 7379     # an existing kvstrata server

Rows (median and best of ``--repeat`` runs after a warm-up, all in this run):

- kvstrata client ``KV.GET`` into a torch tensor (numpy when torch is absent), kvstrata server;
- the same client ``GET`` into the tensor from redis-server (what the client alone achieves);
- redis-py ``GET`` from redis-server and redis-py ``KV.GET`` from kvstrata (bytes, then a copy
  into the tensor, as an engine would have to);
- the loopback limit: a plain socket server process doing ``sendall`` of the same bytes, read
  with ``recv_into`` into the tensor; and the client's reply reader over that same server with
  the bytes framed as a RESP bulk (the client's own cost, without any RESP server's).

DESIGN.md target: the kvstrata client loads a 32 MiB chunk at >= 2.5 GB/s.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from kvstrata.clients import Client
from kvstrata.clients.resp import ReplyReader, as_writable_view

NS = "bench@u8@c256"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def kvstrata_server(size: int) -> Iterator[int]:
    data = tempfile.mkdtemp(prefix="kvbench-")
    cap = f"{max(256, 4 * size // (1 << 20))}MiB"
    argv = [sys.executable, "-m", "kvstrata", "serve", "--port", "0", "--data-dir", data,
            "--dram-capacity", cap, "--nvme-capacity", "0", "--loglevel", "notice"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            m = re.search(r"ready on .* port=(\d+)", line)
            if m:
                break
        else:
            raise RuntimeError("kvstrata serve did not start")
        yield int(m.group(1))
    finally:
        proc.terminate()
        proc.wait(15)
        shutil.rmtree(data, ignore_errors=True)


@contextmanager
def redis_server() -> Iterator[int]:
    port = _free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
         "--proto-max-bulk-len", "1gb"],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                time.sleep(0.02)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


_LOOPBACK_SERVER = """
import socket, sys
size = int(sys.argv[1])
data = bytes(range(256)) * (size // 256)
head, tail = b"$%d\\r\\n" % size, b"\\r\\n"
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (req := conn.recv(1)):
    if req == b"r":  # the same bytes framed as a RESP bulk reply
        for part in (head, data, tail):
            conn.sendall(part)
    else:
        conn.sendall(data)
"""


@contextmanager
def loopback_server(size: int) -> Iterator[int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _LOOPBACK_SERVER, str(size)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        yield int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()


def measure(fn: Callable[[], None], size: int, repeat: int) -> tuple[float, float]:
    fn()  # warm-up: connections, page faults in the destination
    rates = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        rates.append(size / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates), max(rates)


def make_tensor(size: int) -> tuple[Any, str]:
    try:
        import torch

        t = torch.empty(size // 2, dtype=torch.bfloat16)
        t.view(torch.uint8).fill_(0)  # touch the pages once, as a long-lived engine buffer is
        return t, "torch bf16"
    except ImportError:
        return np.zeros(size, dtype=np.uint8), "numpy u8"


def run(args: argparse.Namespace) -> list[tuple[str, float, float]]:
    size = args.size_mib << 20
    payload = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    out, kind = make_tensor(size)
    out_bytes = np.frombuffer(as_writable_view(out), dtype=np.uint8)
    rows: list[tuple[str, float, float]] = []
    key = b"\x01" * 32
    with Client(host=args.host, port=args.port) as kv:
        kv.put(NS, key, None, payload)
        rows.append((f"kvstrata client KV.GET -> {kind}",
                     *measure(lambda: kv.get(NS, key, out=out), size, args.repeat)))  # fmt: skip
        assert np.array_equal(out_bytes, payload)
    with redis_server() as rport, Client(port=rport) as rc:
        rc.execute("SET", "blob", payload)
        rate = measure(lambda: rc.execute("GET", "blob", out=out), size, args.repeat)
        rows.append((f"kvstrata client GET -> {kind} (redis-server)", *rate))
        redis: Any = None
        try:
            import redis
        except ImportError:
            pass
        if redis is not None:
            r = redis.Redis(port=rport)

            def redis_py_get() -> None:
                out_bytes[:] = np.frombuffer(r.get("blob"), dtype=np.uint8)

            rows.append(("redis-py GET + copy (redis-server)",
                         *measure(redis_py_get, size, args.repeat)))  # fmt: skip
            rk = redis.Redis(host=args.host, port=args.port)

            def redis_py_kvget() -> None:
                out_bytes[:] = np.frombuffer(rk.execute_command("KV.GET", NS, key), np.uint8)

            rows.append(("redis-py KV.GET + copy (kvstrata)",
                         *measure(redis_py_kvget, size, args.repeat)))  # fmt: skip
    bare, resp = measure_loopback(size, out, args.repeat)
    rows.append((f"kvstrata reply reader, bare socket server -> {kind}", *resp))
    rows.append((f"loopback limit: sendall / recv_into {kind}", *bare))
    return rows


def measure_loopback(
    size: int, out: Any, repeat: int
) -> tuple[tuple[float, float], tuple[float, float]]:
    """The bare socket limit, and the client's reply reader over the same socket (RESP)."""
    view = as_writable_view(out)
    with loopback_server(size) as port:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def fetch() -> None:
            sock.sendall(b"x")
            got = 0
            while got < size:
                n = sock.recv_into(view[got:size])
                if not n:
                    raise ConnectionError("loopback server went away")
                got += n

        replies: list[Any] = []
        reader = ReplyReader(replies.append, lambda: out)

        def fetch_resp() -> None:
            sock.sendall(b"r")
            while not replies:
                n = sock.recv_into(reader.get_buffer())
                if not n:
                    raise ConnectionError("loopback server went away")
                reader.buffer_updated(n)
            replies.clear()

        try:
            return measure(fetch, size, repeat), measure(fetch_resp, size, repeat)
        finally:
            sock.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="kvstrata server (0: start one)")
    ap.add_argument("--size-mib", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    if args.port:
        rows = run(args)
    else:
        with kvstrata_server(args.size_mib << 20) as port:
            args.port = port
            rows = run(args)
    limit = rows[-1][1]
    redis_py = next((r[1] for r in rows if r[0].startswith("redis-py GET")), float("nan"))
    print(f"\n{args.size_mib} MiB chunk, median/best of {args.repeat}, "
          f"{os.cpu_count()} CPUs, loopback TCP\n")  # fmt: skip
    print(f"| {'path':<56} | median GB/s | best GB/s | x loopback | x redis-py |")
    print(f"|{'-' * 58}|-------------|-----------|------------|------------|")
    for name, med, best in rows:
        print(f"| {name:<56} | {med:11.2f} | {best:9.2f} | {med / limit:10.2f} | "
              f"{med / redis_py:10.2f} |")  # fmt: skip
    print("\nTarget (DESIGN.md): kvstrata client load of a 32 MiB chunk >= 2.5 GB/s.")


if __name__ == "__main__":
    main()
