"""Planned restarts: SHUTDOWN, SHUTDOWN SAVE and SIGTERM write the chunks held only in DRAM to
NVMe before exit, so every chunk is back after the restart; SHUTDOWN NOSAVE skips it; the log
says what was saved, what the time budget cut off, and when there is no NVMe tier at all."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.conftest import TEST_DEFAULTS

CHUNKS = 24
SIZE = 256 * 1024


class LoggedServer:
    """``python -m kvstrata serve`` with its log in a file (to check what shutdown says)."""

    def __init__(self, data_dir: Path, log: Path, **flags: str) -> None:
        values = {**TEST_DEFAULTS, "data-dir": str(data_dir), **flags}
        argv = [sys.executable, "-m", "kvstrata", "serve"]
        for key, value in values.items():
            argv += [f"--{key}", value]
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        self.port = 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.proc.poll() is None:
            m = re.search(r"ready on .* port=(\d+)", log.read_text())
            if m:
                self.port = int(m.group(1))
                return
            time.sleep(0.02)
        raise RuntimeError("server did not start:\n" + log.read_text())

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, retry_on_error=[])

    def stop(self, how: str) -> str:
        """Stop with ``SHUTDOWN [...]``, ``SIGTERM`` or ``SIGINT``; returns the whole log."""
        if how.startswith("SIG"):
            self.proc.send_signal(getattr(signal, how))
        else:
            with pytest.raises(redis.exceptions.ConnectionError):
                self.client().execute_command(*how.split())
        assert self.proc.wait(60) == 0
        return self.log.read_text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def servers() -> Iterator[list[LoggedServer]]:
    started: list[LoggedServer] = []
    yield started
    for srv in started:
        srv.kill()


def _payload(i: int) -> bytes:
    return bytes([i % 251]) * 1000 + os.urandom(SIZE - 1000)


def _fill(srv: LoggedServer) -> dict[bytes, bytes]:
    """CHUNKS chunks of one chain; returns hash → payload."""
    client = srv.client()
    chunks: dict[bytes, bytes] = {}
    parent = b""
    for i in range(CHUNKS):
        h = f"{i:04x}".encode() * 8
        data = _payload(i)
        assert client.execute_command("KV.PUT", "ns", h, parent, data) == 1
        chunks[h] = data
        parent = h
    return chunks


def _tiers_of(srv: LoggedServer, chunks: dict[bytes, bytes]) -> set[str]:
    client = srv.client()
    found: set[str] = set()
    for h in chunks:
        info = client.execute_command("KV.INFO", "ns", h)
        info = dict(zip(info[::2], info[1::2], strict=True)) if isinstance(info, list) else info
        tiers = info[b"tiers"]
        found.add(",".join(t.decode() for t in tiers))
    return found


def _start(tmp_path: Path, servers: list[LoggedServer], n: int, **flags: str) -> LoggedServer:
    srv = LoggedServer(tmp_path / "data", tmp_path / f"log{n}.txt", **flags)
    servers.append(srv)
    return srv


@pytest.mark.parametrize(
    ("policy", "how"),
    [
        ("write-back", "SHUTDOWN"),
        ("write-back", "SHUTDOWN SAVE"),
        ("write-back", "SIGTERM"),
        ("write-back", "SIGINT"),
        ("write-through", "SIGTERM"),
    ],
)
def test_planned_restart_brings_every_chunk_back(
    tmp_path: Path, servers: list[LoggedServer], how: str, policy: str
) -> None:
    """Chunks put into a 64 MiB DRAM tier (write-back: only there; write-through: on NVMe as
    well), a planned stop, a restart on the same data folder: every chunk reads back intact."""
    first = _start(tmp_path, servers, 0, **{"nvme-write-policy": policy})
    chunks = _fill(first)
    assert _tiers_of(first, chunks) == ({"dram"} if policy == "write-back" else {"dram,nvme"})
    log = first.stop(how)
    if policy == "write-back":
        assert f"shutdown: saved {CHUNKS} of {CHUNKS} chunks" in log
    else:
        assert "shutdown: every chunk is already on nvme" in log
    second = _start(tmp_path, servers, 1, **{"nvme-write-policy": policy})
    client = second.client()
    for h, data in chunks.items():
        assert client.execute_command("KV.GET", "ns", h) == data
    assert client.execute_command("KV.MATCH", "ns", *chunks) == CHUNKS


def test_shutdown_nosave_leaves_memory_only_chunks_behind(
    tmp_path: Path, servers: list[LoggedServer]
) -> None:
    first = _start(tmp_path, servers, 0)
    chunks = _fill(first)
    log = first.stop("SHUTDOWN NOSAVE")
    assert "NOSAVE, chunks held only in memory are not written to NVMe" in log
    client = _start(tmp_path, servers, 1).client()
    assert client.execute_command("KV.MATCH", "ns", *chunks) == 0


def test_the_save_is_bounded_by_shutdown_timeout(
    tmp_path: Path, servers: list[LoggedServer]
) -> None:
    first = _start(tmp_path, servers, 0, **{"shutdown-timeout": "0"})
    _fill(first)
    log = first.stop("SIGTERM")
    assert f"shutdown-timeout (0 s) ran out: {CHUNKS} chunks not saved" in log


def test_without_an_nvme_tier_the_log_says_what_is_lost(
    tmp_path: Path, servers: list[LoggedServer]
) -> None:
    first = _start(tmp_path, servers, 0, **{"nvme-capacity": "0"})
    _fill(first)
    log = first.stop("SHUTDOWN")
    assert f"no NVMe tier (nvme-capacity 0): {CHUNKS} chunks (6.0 MiB) held in memory" in log
