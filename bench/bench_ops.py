"""Start-up and planned-shutdown times of ``kvstrata serve``, beside their peers.

Start-up (per DRAM arena size): seconds from ``Popen`` to the first ``+PONG`` (and the CPU
seconds the server had used by then: interpreter start and imports, independent of the load of
the machine), to the first ``KV.STATS`` that is not ``-LOADING`` (ready: KV commands served)
and to ``INFO tiers`` saying ``dram_warming:0`` (warmed: the arena faulted in, in the
background since ready; a checkout without that field counts as warmed when ready), next to
redis-server's time to ``+PONG`` (empty dataset) and to pre-touching a fresh shared-memory
segment of the same size with numpy in this process (the floor of kvstrata's preparation).
``--compare CHECKOUT`` adds the times to ``+PONG`` and to ready of another checkout (e.g.
before the arena warmed in the background).

Shutdown: a DRAM tier filled with 1 MiB chunks (write-back: they are only in DRAM), then
``SHUTDOWN`` (saves them to NVMe) and ``SHUTDOWN NOSAVE``, seconds from the command to the
process's exit; next to writing the same bytes as 1 MiB files with one fsync at the end (the
disk's floor) and redis-server's ``SHUTDOWN SAVE`` of the same bytes as 1 MiB values (an RDB).

    python bench/bench_ops.py                 # 1 GiB and 8 GiB arenas, 1 GiB shutdown
    python bench/bench_ops.py --sizes 1 --fill 0.25
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _servers import free_port

GiB = 1024**3
MiB = 1024**2


def _ask(port: int, command: bytes) -> bytes | None:
    """One command over a fresh connection; None when nothing listens yet."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(command)
            return sock.recv(4096)
    except OSError:
        return None


def _poll(port: int, command: bytes, good: bytes, deadline: float) -> float:
    while time.monotonic() < deadline:
        reply = _ask(port, command)
        if reply is not None and reply.startswith(good):
            return time.monotonic()
        time.sleep(0.002)
    raise RuntimeError(f"no {good!r} on port {port}")


def kvstrata_argv(port: int, data: str, dram: int, nvme: int = 0, **flags: str) -> list[str]:
    # -P: import kvstrata from PYTHONPATH / site-packages, not from the current folder
    argv = [sys.executable, "-P", "-m", "kvstrata", "serve", "--port", str(port),
            "--data-dir", data,
            "--dram-capacity", str(dram), "--nvme-capacity", str(nvme)]  # fmt: skip
    for key, value in flags.items():
        argv += [f"--{key.replace('_', '-')}", value]
    return argv


def _cpu(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _poll_warmed(port: int, deadline: float) -> float:
    while time.monotonic() < deadline:
        reply = _ask(port, b"INFO tiers\r\n") or b""
        if reply.startswith(b"$") and b"dram_warming:1" not in reply:
            return time.monotonic()
        time.sleep(0.05)  # INFO costs the server more than KV.STATS: poll less often
    raise RuntimeError(f"arena on port {port} not warmed")


def startup(dram: int, code: str = "") -> tuple[float, float, float, float]:
    """(seconds to PONG, CPU seconds the server used until then, seconds to ready, seconds to
    warmed) of a kvstrata with a ``dram``-byte arena (the checkout at ``code`` when given)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": code} if code else None
    with tempfile.TemporaryDirectory() as data:
        started = time.monotonic()
        proc = subprocess.Popen(kvstrata_argv(port, data, dram), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env)  # fmt: skip
        try:
            deadline = started + 300
            pong = _poll(port, b"PING\r\n", b"+PONG", deadline) - started
            cpu = _cpu(proc.pid)
            ready = _poll(port, b"KV.STATS\r\n", b"*", deadline) - started
            ready = max(ready, pong)
            warmed = max(_poll_warmed(port, deadline) - started, ready)
        finally:
            proc.terminate()
            proc.wait(120)
    return pong, cpu, ready, warmed


def redis_startup() -> float:
    port = free_port()
    started = time.monotonic()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)  # fmt: skip
    try:
        return _poll(port, b"PING\r\n", b"+PONG", started + 60) - started
    finally:
        proc.terminate()
        proc.wait(30)


def pretouch_floor(size: int) -> float:
    shm = shared_memory.SharedMemory(create=True, size=size)
    try:
        started = time.monotonic()
        arena = np.frombuffer(shm.buf, dtype=np.uint8)
        for start in range(0, size, 64 * MiB):
            arena[start : start + 64 * MiB].fill(0)
        del arena
        return time.monotonic() - started
    finally:
        shm.close()
        shm.unlink()


def _fill(client: redis.Redis, nbytes: int, kv: bool) -> int:
    payload = os.urandom(MiB)
    count = nbytes // MiB
    pipe = client.pipeline(transaction=False)
    for i in range(count):
        key = f"{i:016x}"
        if kv:
            pipe.execute_command("KV.PUT", "bench", key, "", payload)
        else:
            pipe.set(key, payload)
        if i % 32 == 31:
            pipe.execute()
    pipe.execute()
    return count


def _timed_shutdown(proc: subprocess.Popen[bytes], port: int, command: bytes) -> float:
    started = time.monotonic()
    _ask(port, command)
    proc.wait(300)
    return time.monotonic() - started


def kvstrata_shutdown(dram: int, fill: float, save: bool) -> tuple[float, int]:
    port = free_port()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DISK_DIR")) as data:
        argv = kvstrata_argv(port, data, dram, nvme=2 * dram, shutdown_timeout="600")
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _poll(port, b"KV.STATS\r\n", b"*", time.monotonic() + 300)
            client = redis.Redis(port=port)
            count = _fill(client, int(dram * fill), kv=True)
            dram_only = client.info("tiers")["dram_chunks"]
            client.close()
            seconds = _timed_shutdown(proc, port, b"SHUTDOWN\r\n" if save else
                                      b"SHUTDOWN NOSAVE\r\n")  # fmt: skip
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return seconds, min(count, int(dram_only))


def redis_shutdown_save(nbytes: int) -> float:
    port = free_port()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DISK_DIR")) as data:
        proc = subprocess.Popen(["redis-server", "--port", str(port), "--dir", data, "--save", "",
                                 "--appendonly", "no"], stdout=subprocess.DEVNULL)  # fmt: skip
        try:
            _poll(port, b"PING\r\n", b"+PONG", time.monotonic() + 60)
            client = redis.Redis(port=port)
            _fill(client, nbytes, kv=False)
            client.close()
            return _timed_shutdown(proc, port, b"SHUTDOWN SAVE\r\n")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def file_floor(nbytes: int) -> float:
    payload = os.urandom(MiB)
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DISK_DIR")) as folder:
        started = time.monotonic()
        for i in range(nbytes // MiB):
            with open(os.path.join(folder, f"{i:06d}"), "wb") as f:
                f.write(payload)
        os.sync()
        return time.monotonic() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1,8", help="arena sizes in GiB for start-up")
    p.add_argument("--shutdown-size", type=float, default=1.0, help="DRAM tier in GiB")
    p.add_argument("--fill", type=float, default=0.9, help="fraction of it filled")
    p.add_argument(
        "--compare",
        metavar="CHECKOUT",
        default="",
        help="also time the start-up of kvstrata from another checkout (PYTHONPATH)",
    )
    p.add_argument(
        "--code",
        metavar="CHECKOUT",
        default="",
        help="time the start-up of this checkout (PYTHONPATH) instead of the installed kvstrata",
    )
    p.add_argument("--no-shutdown", action="store_true", help="start-up only")
    args = p.parse_args()
    print("start-up (seconds from exec)")
    other = f"{'CHECKOUT PONG':>14} {'CHECKOUT ready':>15} " if args.compare else ""
    print(f"{'arena':>8} {'kvstrata PONG':>14} {'(CPU s)':>8} {'kvstrata ready':>15} "
          f"{'warmed':>8} {other}{'redis PONG':>11} {'numpy pre-touch':>16}")  # fmt: skip
    for gib in (float(s) for s in args.sizes.split(",")):
        size = int(gib * GiB)
        pong, cpu, ready, warmed = startup(size, args.code)
        then = ""
        if args.compare:
            other_pong, _, other_ready, _ = startup(size, args.compare)
            then = f"{other_pong:>14.3f} {other_ready:>15.3f} "
        print(f"{gib:>6g}Gi {pong:>14.3f} {cpu:>8.2f} {ready:>15.3f} {warmed:>8.3f} {then}"
              f"{redis_startup():>11.3f} {pretouch_floor(size):>16.3f}", flush=True)  # fmt: skip
    if args.no_shutdown:
        return
    dram = int(args.shutdown_size * GiB)
    nbytes = int(dram * args.fill)
    print(f"\nshutdown with {nbytes / GiB:.2f} GiB in a {args.shutdown_size:g} GiB DRAM tier "
          "(seconds from the command to exit)")  # fmt: skip
    save, chunks = kvstrata_shutdown(dram, args.fill, save=True)
    nosave, _ = kvstrata_shutdown(dram, args.fill, save=False)
    floor = file_floor(nbytes)
    rdb = redis_shutdown_save(nbytes)
    print(f"{'kvstrata SHUTDOWN (saves ' + str(chunks) + ' chunks)':<44} {save:8.3f}")
    print(f"{'kvstrata SHUTDOWN NOSAVE':<44} {nosave:8.3f}")
    print(f"{'1 MiB files + sync, same bytes':<44} {floor:8.3f}")
    print(f"{'redis-server SHUTDOWN SAVE, same bytes':<44} {rdb:8.3f}")


if __name__ == "__main__":
    main()
