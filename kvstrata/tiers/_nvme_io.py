"""Blocking file I/O of the NVMe tier: POSIX (O_DIRECT or buffered) and kvikio backends.

Every function here runs on the tier's thread pool and raises ``OSError`` on failure; the tier
turns that into :class:`~kvstrata.tiers.base.TierIOError`. Both backends write and read the
same file format (``_nvme_format``): a 4096-byte header block, the payload at offset 4096.

O_DIRECT needs buffer addresses, file offsets and lengths aligned to the logical block size
(4096 covers every device in use). Payload bytes at an aligned address (an arena slot, a fresh
numpy array) go to and from the disk directly; unaligned ones and the last partial block go
through a per-thread page-aligned staging buffer. A file is then truncated to its exact length
(``4096 + payload``), so its size alone tells a complete file from a torn one.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from typing import Protocol

import numpy as np

from kvstrata.tiers._nvme_format import HEADER_SIZE

BLOCK = 4096
STAGING = 8 * 1024 * 1024
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_local = threading.local()


class Backend(Protocol):
    name: str
    direct: bool

    def write_file(self, path: str, header: bytes, payload: memoryview) -> None:
        """Create ``path`` (must not exist) with header and payload, fsync it."""

    def read_file(self, path: str, out: memoryview) -> tuple[bytes, int]:
        """Header block and the payload bytes read into ``out`` (up to ``len(out)``)."""


def _staging() -> memoryview:
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = memoryview(mmap.mmap(-1, STAGING))  # anonymous maps are page aligned
        _local.buf = buf
    return buf


def _aligned(view: memoryview) -> bool:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) % BLOCK == 0 if view else True


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwritev(fd, [view], offset)
        if n <= 0:
            raise OSError(errno.EIO, "write returned 0 bytes")
        view, offset = view[n:], offset + n


def _pread_all(fd: int, view: memoryview, offset: int) -> int:
    """Read until ``view`` is full or end of file; returns the bytes read."""
    total = 0
    while total < len(view):
        n = os.preadv(fd, [view[total:]], offset + total)
        if n <= 0:
            break
        total += n
    return total


class PosixBackend:
    """pwritev/preadv on a thread pool, with O_DIRECT when ``direct``."""

    name = "posix"

    def __init__(self, direct: bool) -> None:
        self.direct = direct

    def write_file(self, path: str, header: bytes, payload: memoryview) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        fd = os.open(path, flags | (_O_DIRECT if self.direct else 0), 0o644)
        try:
            if self.direct:
                self._write_direct(fd, header, payload)
            else:
                _pwrite_all(fd, memoryview(header), 0)
                _pwrite_all(fd, payload, HEADER_SIZE)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _write_direct(self, fd: int, header: bytes, payload: memoryview) -> None:
        stage = _staging()
        stage[:HEADER_SIZE] = header
        _pwrite_all(fd, stage[:HEADER_SIZE], 0)
        body = len(payload) // BLOCK * BLOCK
        if _aligned(payload):
            _pwrite_all(fd, payload[:body], HEADER_SIZE)
        else:
            for pos in range(0, body, STAGING):
                n = min(STAGING, body - pos)
                stage[:n] = payload[pos : pos + n]
                _pwrite_all(fd, stage[:n], HEADER_SIZE + pos)
        tail = len(payload) - body
        if tail:
            stage[:tail] = payload[body:]
            stage[tail:BLOCK] = bytes(BLOCK - tail)
            _pwrite_all(fd, stage[:BLOCK], HEADER_SIZE + body)
            os.ftruncate(fd, HEADER_SIZE + len(payload))

    def read_file(self, path: str, out: memoryview) -> tuple[bytes, int]:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (_O_DIRECT if self.direct else 0))
        try:
            if not self.direct:
                header = os.pread(fd, HEADER_SIZE, 0)
                return header, _pread_all(fd, out, HEADER_SIZE)
            stage = _staging()
            if _pread_all(fd, stage[:HEADER_SIZE], 0) < HEADER_SIZE:
                return bytes(stage[:0]), 0
            header = bytes(stage[:HEADER_SIZE])
            return header, self._read_direct(fd, out)
        finally:
            os.close(fd)

    def _read_direct(self, fd: int, out: memoryview) -> int:
        stage = _staging()
        body = len(out) // BLOCK * BLOCK
        if _aligned(out):
            got = _pread_all(fd, out[:body], HEADER_SIZE)
            if got < body:
                return got
        else:
            for pos in range(0, body, STAGING):
                n = min(STAGING, body - pos)
                got = _pread_all(fd, stage[:n], HEADER_SIZE + pos)
                out[pos : pos + got] = stage[:got]
                if got < n:
                    return pos + got
        tail = len(out) - body
        if not tail:
            return body
        got = _pread_all(fd, stage[:BLOCK], HEADER_SIZE + body)
        got = min(got, tail)
        out[body : body + got] = stage[:got]
        return body + got


class KvikioBackend:
    """kvikio CuFile (GPUDirect Storage where the driver allows, its own thread pool else)."""

    name = "kvikio"
    direct = True

    def write_file(self, path: str, header: bytes, payload: memoryview) -> None:
        import kvikio

        with kvikio.CuFile(path, "w") as f:
            head = np.frombuffer(header, dtype=np.uint8)
            body = np.frombuffer(payload, dtype=np.uint8)
            futures = [f.pwrite(head, HEADER_SIZE, 0)]
            if len(body):
                futures.append(f.pwrite(body, len(body), HEADER_SIZE))
            for fut in futures:
                fut.get()
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def read_file(self, path: str, out: memoryview) -> tuple[bytes, int]:
        import kvikio

        head = np.empty(HEADER_SIZE, dtype=np.uint8)
        body = np.frombuffer(out, dtype=np.uint8)
        with kvikio.CuFile(path, "r") as f:
            if int(f.pread(head, HEADER_SIZE, 0).get()) < HEADER_SIZE:
                return b"", 0
            got = int(f.pread(body, len(body), HEADER_SIZE).get()) if len(body) else 0
        return head.tobytes(), got


def probe_direct(folder: str) -> tuple[bool, str]:
    """Whether ``folder``'s filesystem takes O_DIRECT writes; raises OSError if unwritable."""
    path = os.path.join(folder, ".kvstrata-probe")
    if not _O_DIRECT:
        return False, "O_DIRECT is not available on this platform"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o644)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False, "the filesystem refuses O_DIRECT"
    try:
        _pwrite_all(fd, _staging()[:BLOCK], 0)
        return True, "O_DIRECT"
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False, "the filesystem refuses O_DIRECT writes"
    finally:
        os.close(fd)
        os.unlink(path)


def probe_writable(folder: str) -> None:
    """Create and remove a file in ``folder``; raises OSError when that fails."""
    path = os.path.join(folder, ".kvstrata-probe")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.close(fd)
    os.unlink(path)
