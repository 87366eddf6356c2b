"""A real server killed with SIGKILL during a write burst comes back with every chunk its NVMe
write policy promised, byte for byte, and reports the rebuild in INFO persistence."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from pathlib import Path

import redis

NS = "persist@u8@c16"


def _payload(i: int) -> bytes:
    return hashlib.sha256(b"%d" % i).digest() * 2048  # 64 KiB, distinct per chunk


def test_kill_during_write_burst_then_restart(make_process_server, tmp_path: Path) -> None:
    """Scenario: with nvme-write-policy write-through, a client stores chunks as fast as it can;
    the server is killed with SIGKILL mid-burst and restarted on the same data folder. Every
    acknowledged chunk is served intact after the restart (from NVMe), nothing else is served,
    and INFO persistence counts the rebuilt chunks."""
    data = tmp_path / "data"
    srv = make_process_server(data_dir=data, nvme_write_policy="write-through")
    acked: list[int] = []
    stop = threading.Event()

    def writer() -> None:
        r = redis.Redis(port=srv.port, socket_timeout=5)
        i = 0
        try:
            while not stop.is_set():
                parent = b"" if i == 0 else b"c%d" % (i - 1)
                r.execute_command("KV.PUT", NS, b"c%d" % i, parent, _payload(i))
                acked.append(i)
                i += 1
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            pass

    thread = threading.Thread(target=writer)
    thread.start()
    deadline = time.monotonic() + 20
    while len(acked) < 40 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.process is not None
    os.kill(srv.process.pid, signal.SIGKILL)
    srv.process.wait()
    stop.set()
    thread.join(10)
    assert len(acked) >= 40

    again = make_process_server(data_dir=data, nvme_write_policy="write-through")
    r = redis.Redis(port=again.port, socket_timeout=10)
    for i in acked:
        assert r.execute_command("KV.GET", NS, b"c%d" % i) == _payload(i), i
    n = len(acked)
    assert r.execute_command("KV.MATCH", NS, *[b"c%d" % i for i in range(n)]) == n
    beyond = r.execute_command("KV.GET", NS, b"c%d" % (n + 1))
    assert beyond is None  # never acknowledged, never started: not there
    info = r.info("persistence")
    assert info["rebuild_chunks"] >= n
