"""Probes of a server *process* for the overload tests: its RSS and CPU time from /proc, the
latency another client sees, and a wait on the server's own byte counters (no sleeps)."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

import redis


def rss_bytes(pid: int) -> int:
    """VmRSS of ``pid``."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time used so far by ``pid``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ping_seconds(port: int, count: int = 5) -> float:
    """The worst round trip of ``count`` PINGs on a fresh connection."""
    worst = 0.0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        for _ in range(count):
            started = time.perf_counter()
            sock.sendall(b"PING\r\n")
            assert sock.recv(64) == b"+PONG\r\n"
            worst = max(worst, time.perf_counter() - started)
    return worst


def idle_window(pid: int, port: int) -> tuple[float, float]:
    """Over a 2 s window, a PING every 0.1 s: the share of one core ``pid`` used, and the worst
    PING round trip."""
    cpu0, wall0 = cpu_seconds(pid), time.monotonic()
    worst = 0.0
    for _ in range(20):
        worst = max(worst, ping_seconds(port, count=1))
        time.sleep(0.1)  # pacing the probe, not synchronisation
    return (cpu_seconds(pid) - cpu0) / (time.monotonic() - wall0), worst


def wait_until(cond: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def wait_received(r: redis.Redis, before: int, nbytes: int) -> None:
    """Wait until the server counted ``nbytes`` more input bytes than ``before`` (not counting
    the INFO commands this poll sends)."""
    polls = 0

    def done() -> bool:
        nonlocal polls
        polls += 1
        got = int(r.info("stats")["total_net_input_bytes"])
        return got - before - polls * len(b"*2\r\n$4\r\nINFO\r\n$5\r\nstats\r\n") >= nbytes

    wait_until(done, what=f"the server to receive {nbytes} bytes")


def input_bytes(r: redis.Redis) -> int:
    return int(r.info("stats")["total_net_input_bytes"])


def open_raw(port: int, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(data)
    return sock


def closed_by_peer(sock: socket.socket, timeout: float = 30.0) -> bool:
    """True when the server closes ``sock`` within ``timeout`` (whatever it sent before)."""
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not sock.recv(1 << 20):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return False
