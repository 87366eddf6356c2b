"""The DRAM arena's warm-up never changes a byte, and a server with a large arena serves at once.

Unit cases run the page warmer (MADV_POPULATE_WRITE and its read fallback) over a segment
whose pages already hold data. The end-to-end case starts ``kvstrata serve`` with an 8 GiB
arena (this machine's ``/dev/shm`` is 24 GiB: ``df -h /dev/shm``; the warm-up is stopped by
the shutdown long before it has faulted the whole arena in) and stores and reads a chunk within
one second of the first PONG, while INFO shows the warm-up still running.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import shutil
import socket
import subprocess
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path

import pytest
import redis

from kvstrata.chunks import ChunkKey
from kvstrata.tiers import _dram_warm
from kvstrata.tiers._dram_warm import PAGE, PageWarmer
from kvstrata.tiers.dram import DramConfig, DramTier
from tests.conftest import free_port

MiB = 1024 * 1024


def _segment(size: int) -> shared_memory.SharedMemory:
    return shared_memory.SharedMemory(create=True, size=size)


def _fill_some_pages(buf: memoryview) -> dict[int, bytes]:
    """Random bytes in scattered pages (others stay never-touched holes)."""
    written = {}
    for page in (0, 1, 7, 100, 255):
        data = os.urandom(PAGE - 3)
        buf[page * PAGE + 3 : (page + 1) * PAGE] = data
        written[page] = data
    return written


def _backed(shm: shared_memory.SharedMemory) -> int:
    """Bytes of the segment tmpfs has allocated pages for."""
    return os.stat(f"/dev/shm/{shm.name}").st_blocks * 512


@pytest.mark.parametrize("force_read", [False, True], ids=["madvise", "read"])
def test_warming_keeps_every_byte(force_read: bool) -> None:
    shm = _segment(256 * PAGE)
    try:
        buf = shm.buf
        assert buf is not None
        written = _fill_some_pages(buf)
        warmer = PageWarmer(buf, force_read=force_read)
        warmer.warm(0, 128 * PAGE)
        assert _backed(shm) >= 128 * PAGE  # the pages are allocated now, not on first write
        warmer.warm(128 * PAGE, 256 * PAGE)
        assert _backed(shm) == 256 * PAGE
        for page, data in written.items():
            assert bytes(buf[page * PAGE + 3 : (page + 1) * PAGE]) == data
            assert bytes(buf[page * PAGE : page * PAGE + 3]) == b"\0\0\0"
        assert bytes(buf[2 * PAGE : 7 * PAGE]) == bytes(5 * PAGE)
        assert warmer.method == ("read" if force_read else "madvise")
        del buf, warmer
    finally:
        shm.close()
        shm.unlink()


def test_a_kernel_without_the_advice_falls_back_to_reading(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []

    def old_kernel(addr: int, length: int, advice: int) -> int:
        calls.append(advice)
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(_dram_warm, "_libc_madvise", lambda: old_kernel)
    shm = _segment(256 * PAGE)
    try:
        buf = shm.buf
        assert buf is not None
        written = _fill_some_pages(buf)
        warmer = PageWarmer(buf)
        warmer.warm(0, 256 * PAGE)
        assert calls == [_dram_warm.MADV_POPULATE_WRITE] and warmer.method == "read"
        warmer.warm(0, 256 * PAGE)  # no second try of the advice
        assert len(calls) == 1
        for page, data in written.items():
            assert bytes(buf[page * PAGE + 3 : (page + 1) * PAGE]) == data
        del buf, warmer
    finally:
        shm.close()
        shm.unlink()


def test_a_failed_warm_up_is_reported_and_the_tier_keeps_serving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """madvise fails with EFAULT (a segment /dev/shm cannot back): the warm-up stops, INFO
    says why, the tier still stores and reads chunks."""

    def no_room(addr: int, length: int, advice: int) -> int:
        ctypes.set_errno(errno.EFAULT)
        return -1

    monkeypatch.setattr(_dram_warm, "_libc_madvise", lambda: no_room)

    async def scenario() -> None:
        tier = DramTier(DramConfig(capacity=8 * MiB, name_prefix="kvstrata-warm-test",
                                   defer_pretouch=True))  # fmt: skip
        try:
            await tier.prepare()
            await tier.wait_warm()
            info = tier.info()
            assert info["warming"] == 0 and "Bad address" in info["warm_error"]
            view = tier.reserve(ChunkKey("ns", b"\x01"), 5000)
            view[:] = b"z" * 5000
            assert bytes(view) == b"z" * 5000
        finally:
            await tier.close()

    asyncio.run(scenario())


def _pong(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


ARENA_GIB = 8


@pytest.mark.skipif(
    shutil.disk_usage("/dev/shm").free < (ARENA_GIB + 1) * 1024**3,
    reason=f"/dev/shm cannot hold a {ARENA_GIB} GiB arena (df -h /dev/shm)",
)
def test_an_8gib_arena_stores_and_reads_within_one_second_of_pong(tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "kvstrata", "serve", "--port", str(port),
            "--data-dir", str(tmp_path / "data"), "--dram-capacity", f"{ARENA_GIB}GiB",
            "--nvme-capacity", "0"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not _pong(port):
            assert proc.poll() is None, "the server exited"
            assert time.monotonic() < deadline, "no PONG within 60 s"
            time.sleep(0.005)  # polling a subprocess's port: nothing to wait on
        pong = time.monotonic()
        client = redis.Redis(port=port, retry_on_error=[], socket_timeout=10)
        payload = os.urandom(4 * MiB)
        while True:  # the store may still be importing: -LOADING until it is built
            try:
                assert client.execute_command("KV.PUT", "ns", "ab", "", payload) is not None
                break
            except redis.exceptions.BusyLoadingError:
                assert time.monotonic() - pong < 1.0, "still -LOADING 1 s after PONG"
        assert client.execute_command("KV.GET", "ns", "ab") == payload
        elapsed = time.monotonic() - pong
        tiers = client.info("tiers")
        assert elapsed < 1.0, f"stored and read {elapsed:.2f} s after PONG"
        assert tiers["dram_capacity"] == ARENA_GIB * 1024**3
        # Faulting 8 GiB in takes seconds (~1 GB/s): it is still going on in the background.
        assert tiers["dram_warming"] == 1 and tiers["dram_warmed_percent"] < 100, tiers
        client.close()
    finally:
        proc.terminate()
        proc.wait(60)
