"""Start redis-server and kvstrata side by side for benchmarks; read their CPU time; time a call."""

from __future__ import annotations

import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Proc:
    name: str
    port: int
    process: subprocess.Popen[str]

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the server process so far."""
        with open(f"/proc/{self.process.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return (int(fields[11]) + int(fields[12])) / ticks


def thread_cpu_seconds(proc: Proc) -> float:
    """On-CPU time (user + system) of all the server's threads, in nanosecond resolution
    (/proc/PID/task/*/schedstat; /proc/PID/stat counts 10 ms ticks, too coarse here)."""
    total = 0
    for task in Path(f"/proc/{proc.process.pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total / 1e9


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


@contextmanager
def redis_server() -> Iterator[Proc]:
    if shutil.which("redis-server") is None:
        sys.exit("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
         "--protected-mode", "no", "--loglevel", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        wait_port(port)
        yield Proc("redis-server", port, proc)
    finally:
        proc.terminate()
        proc.wait()


@contextmanager
def kvstrata_server(*extra: str, checkout: str | None = None) -> Iterator[Proc]:
    """``kvstrata serve`` on a free port; ``checkout``: run the code of another checkout
    (``--compare`` runs of the benches), else whatever ``import kvstrata`` finds here."""
    data = tempfile.mkdtemp(prefix="kvstrata-bench-")
    argv = [sys.executable, "-m", "kvstrata", "serve", "--port", "0", "--data-dir", data,
            "--loglevel", "notice", *extra]  # fmt: skip
    env = None if checkout is None else {**os.environ, "PYTHONPATH": checkout}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=checkout
    )
    assert proc.stdout is not None
    port = 0
    for line in proc.stdout:
        m = re.search(r"ready on .* port=(\d+)", line)
        if m:
            port = int(m.group(1))
            break
    if not port:
        proc.kill()
        raise RuntimeError("kvstrata did not start")
    threading.Thread(target=lambda: [None for _ in proc.stdout or []], daemon=True).start()
    try:
        yield Proc("kvstrata", port, proc)
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(data, ignore_errors=True)


def wait_warmed(kv: Any, timeout: float = 120) -> float:
    """Until kvstrata's arena has warmed (``INFO tiers`` no longer says ``dram_warming:1``;
    the server faults its pages in on a worker thread after it is ready, which takes CPU and
    memory bandwidth from whatever is measured meanwhile); returns the seconds waited. ``kv``:
    a blocking :class:`kvstrata.clients.Client`."""
    started = time.monotonic()
    while b"dram_warming:1" in bytes(kv.execute("INFO", "tiers")):
        if time.monotonic() - started > timeout:
            raise RuntimeError("kvstrata's arena did not warm")
        time.sleep(0.05)  # a poll of the server, not a test's synchronisation
    return time.monotonic() - started


def timed(fn: Callable[[], object], rounds: int) -> float:
    """Median seconds of ``fn()`` over ``rounds`` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)
