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
import importlib.util
import logging
import mmap
import os
import threading
from typing import Protocol

import numpy as np

from kvstrata.tiers import _cuda
from kvstrata.tiers._nvme_format import HEADER_SIZE
from kvstrata.tiers.base import TierUnavailable

log = logging.getLogger(__name__)

BLOCK = 4096
STAGING = 8 * 1024 * 1024
FileId = tuple[int, int]  # (st_dev, st_ino): which file a path named when it was opened
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_local = threading.local()


class Backend(Protocol):
    name: str
    direct: bool

    def write_file(self, path: str, header: bytes, payload: memoryview) -> int:
        """Create ``path`` (must not exist) with header and payload, not synced; returns a
        descriptor open on it (the caller fsyncs it as its policy says, and closes it)."""

    def read_file(self, path: str, out: memoryview) -> tuple[bytes, int, FileId]:
        """Header block, the payload bytes read into ``out`` (up to ``len(out)``), and the
        identity of the file read (a rename may put another file under ``path`` meanwhile)."""

    def write_at(self, fd: int, path: str, offset: int, header: bytes, payload: memoryview) -> None:
        """Header and payload at ``offset`` (4096-aligned) of the open slab file ``fd`` (its
        name: ``path``); with O_DIRECT the last block is zero-padded. Not synced."""

    def read_at(self, fd: int, path: str, offset: int, out: memoryview) -> tuple[bytes, int]:
        """The header block at ``offset`` of a slab file and up to ``len(out)`` payload bytes
        after it, read into ``out``; (header, payload bytes read)."""


def file_id(fd: int) -> FileId:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _staging() -> memoryview:
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = memoryview(mmap.mmap(-1, STAGING))  # anonymous maps are page aligned
        _local.buf = buf
    return buf


def _aligned(view: memoryview) -> bool:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) % BLOCK == 0 if view else True


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    while views and n >= len(views[0]):
        n -= len(views[0])
        views = views[1:]
    if views and n:
        views = [views[0][n:], *views[1:]]
    return views


def _pwrite_all(fd: int, views: list[memoryview], offset: int) -> None:
    views = [v for v in views if len(v)]
    while views:
        n = os.pwritev(fd, views, offset)
        if n <= 0:
            raise OSError(errno.EIO, "write returned 0 bytes")
        views, offset = _advance(views, n), offset + n


def _pread_all(fd: int, views: list[memoryview], offset: int) -> int:
    """Fill ``views`` from ``offset`` until they are full or the file ends; bytes read."""
    views = [v for v in views if len(v)]
    total = 0
    while views:
        n = os.preadv(fd, views, offset + total)
        if n <= 0:
            break
        total += n
        views = _advance(views, n)
    return total


def _padded(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK * BLOCK


class PosixBackend:
    """pwritev/preadv on a thread pool, with O_DIRECT when ``direct``.

    With O_DIRECT and an aligned payload, header, payload and padded last block go in one
    ``pwritev``/``preadv`` call; otherwise the file image streams through the staging buffer.
    """

    name = "posix"

    def __init__(self, direct: bool) -> None:
        self.direct = direct

    def write_file(self, path: str, header: bytes, payload: memoryview) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        fd = os.open(path, flags | (_O_DIRECT if self.direct else 0), 0o600)
        try:
            if not self.direct:
                _pwrite_all(fd, [memoryview(header), payload], 0)
            else:
                self._write(fd, header, payload, 0)
            if self.direct and len(payload) % BLOCK:
                os.ftruncate(fd, HEADER_SIZE + len(payload))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def write_at(self, fd: int, path: str, offset: int, header: bytes, payload: memoryview) -> None:
        if self.direct:
            self._write(fd, header, payload, offset)
        else:
            _pwrite_all(fd, [memoryview(header), payload], offset)

    def read_at(self, fd: int, path: str, offset: int, out: memoryview) -> tuple[bytes, int]:
        if not self.direct:
            head = bytearray(HEADER_SIZE)
            got = _pread_all(fd, [memoryview(head), out], offset)
            return bytes(head[: min(got, HEADER_SIZE)]), max(0, got - HEADER_SIZE)
        if _aligned(out):
            return self._read_direct(fd, out, offset)
        return self._read_staged(fd, out, offset)

    def _write(self, fd: int, header: bytes, payload: memoryview, offset: int) -> None:
        if _aligned(payload):
            self._write_direct(fd, header, payload, offset)
        else:
            self._write_staged(fd, header, payload, offset)

    def _write_direct(self, fd: int, header: bytes, payload: memoryview, offset: int) -> None:
        stage = _staging()
        stage[:HEADER_SIZE] = header
        body = len(payload) // BLOCK * BLOCK
        tail = len(payload) - body
        views = [stage[:HEADER_SIZE], payload[:body]]
        if tail:
            last = stage[HEADER_SIZE : HEADER_SIZE + BLOCK]
            last[:tail] = payload[body:]
            last[tail:] = bytes(BLOCK - tail)
            views.append(last)
        _pwrite_all(fd, views, offset)

    def _write_staged(self, fd: int, header: bytes, payload: memoryview, offset: int) -> None:
        stage = _staging()
        stage[:HEADER_SIZE] = header
        fill, src, pos = HEADER_SIZE, 0, offset
        while True:
            n = min(STAGING - fill, len(payload) - src)
            stage[fill : fill + n] = payload[src : src + n]
            fill, src = fill + n, src + n
            if src == len(payload):
                end = _padded(fill)
                stage[fill:end] = bytes(end - fill)
                _pwrite_all(fd, [stage[:end]], pos)
                return
            _pwrite_all(fd, [stage[:fill]], pos)
            pos, fill = pos + fill, 0

    def read_file(self, path: str, out: memoryview) -> tuple[bytes, int, FileId]:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (_O_DIRECT if self.direct else 0))
        try:
            if not self.direct:
                head = bytearray(HEADER_SIZE)
                got = _pread_all(fd, [memoryview(head), out], 0)
                header, payload = bytes(head[: min(got, HEADER_SIZE)]), max(0, got - HEADER_SIZE)
            elif _aligned(out):
                header, payload = self._read_direct(fd, out)
            else:
                header, payload = self._read_staged(fd, out)
            return header, payload, file_id(fd)
        finally:
            os.close(fd)

    def _read_direct(self, fd: int, out: memoryview, offset: int = 0) -> tuple[bytes, int]:
        stage = _staging()
        body = len(out) // BLOCK * BLOCK
        tail = len(out) - body
        last = stage[HEADER_SIZE : HEADER_SIZE + BLOCK]
        views = [stage[:HEADER_SIZE], out[:body]] + ([last] if tail else [])
        got = _pread_all(fd, views, offset)
        if got < HEADER_SIZE:
            return b"", 0
        payload = min(got - HEADER_SIZE, len(out))
        if payload > body:
            out[body:payload] = last[: payload - body]
        return bytes(stage[:HEADER_SIZE]), payload

    def _read_staged(self, fd: int, out: memoryview, offset: int = 0) -> tuple[bytes, int]:
        stage = _staging()
        want = _padded(HEADER_SIZE + len(out))
        got = _pread_all(fd, [stage[: min(STAGING, want)]], offset)
        if got < HEADER_SIZE:
            return b"", 0
        header = bytes(stage[:HEADER_SIZE])
        done = min(got - HEADER_SIZE, len(out))
        out[:done] = stage[HEADER_SIZE : HEADER_SIZE + done]
        pos = got
        while done < len(out) and got == STAGING:
            got = _pread_all(fd, [stage[: min(STAGING, want - pos)]], offset + pos)
            n = min(got, len(out) - done)
            out[done : done + n] = stage[:n]
            done, pos = done + n, pos + got
        return header, done


class KvikioBackend:
    """kvikio CuFile (GPUDirect Storage where the driver allows, its own thread pool else)."""

    name = "kvikio"
    direct = True

    def write_file(self, path: str, header: bytes, payload: memoryview) -> int:
        import kvikio

        with kvikio.CuFile(path, "w") as f:
            head = np.frombuffer(header, dtype=np.uint8)
            body = np.frombuffer(payload, dtype=np.uint8)
            futures = [f.pwrite(head, HEADER_SIZE, 0)]
            if len(body):
                futures.append(f.pwrite(body, len(body), HEADER_SIZE))
            for fut in futures:
                fut.get()
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def read_file(self, path: str, out: memoryview) -> tuple[bytes, int, FileId]:
        import kvikio

        head = np.empty(HEADER_SIZE, dtype=np.uint8)
        body = np.frombuffer(out, dtype=np.uint8)
        # CuFile opens by path: the identity comes from a descriptor opened first and held
        # throughout. If a rename lands between the two opens, CuFile reads the newer file and
        # the identity names the older one, which no longer has the name: a corrupt read then
        # quarantines nothing (a later read will), never the wrong file.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            ident = file_id(fd)
            with kvikio.CuFile(path, "r") as f:
                if int(f.pread(head, HEADER_SIZE, 0).get()) < HEADER_SIZE:
                    return b"", 0, ident
                got = int(f.pread(body, len(body), HEADER_SIZE).get()) if len(body) else 0
        finally:
            os.close(fd)
        return head.tobytes(), got, ident

    def write_at(self, fd: int, path: str, offset: int, header: bytes, payload: memoryview) -> None:
        import kvikio

        with kvikio.CuFile(path, "r+") as f:
            futures = [f.pwrite(np.frombuffer(header, dtype=np.uint8), HEADER_SIZE, offset)]
            if len(payload):
                body = np.frombuffer(payload, dtype=np.uint8)
                futures.append(f.pwrite(body, len(body), offset + HEADER_SIZE))
            for fut in futures:
                fut.get()

    def read_at(self, fd: int, path: str, offset: int, out: memoryview) -> tuple[bytes, int]:
        import kvikio

        head = np.empty(HEADER_SIZE, dtype=np.uint8)
        body = np.frombuffer(out, dtype=np.uint8)
        with kvikio.CuFile(path, "r") as f:
            if int(f.pread(head, HEADER_SIZE, offset).get()) < HEADER_SIZE:
                return b"", 0
            got = int(f.pread(body, len(body), offset + HEADER_SIZE).get()) if len(body) else 0
        return head.tobytes(), got


def choose_backend(root: str, wanted: str, direct: str) -> tuple[Backend, str]:
    """The backend for ``nvme-backend`` ``wanted`` and O_DIRECT setting ``direct``, and why."""
    if wanted not in ("auto", "posix", "kvikio"):
        raise TierUnavailable(f"nvme backend must be auto, posix or kvikio, not {wanted!r}")
    if wanted != "posix":
        why = None if importlib.util.find_spec("kvikio") else "kvikio is not installed"
        why = why or _cuda.cuda_unavailable_reason()
        if why is None:
            return KvikioBackend(), "kvikio with CUDA"
        if wanted == "kvikio":
            raise TierUnavailable(f"nvme backend kvikio is not usable: {why}")
    if direct == "no":
        return PosixBackend(direct=False), "buffered (nvme direct=no)"
    try:
        usable, why = probe_direct(root)
    except OSError as exc:
        raise TierUnavailable(f"nvme-path {root} is not writable: {exc}") from exc
    if not usable:
        if direct == "yes":
            raise TierUnavailable(f"nvme O_DIRECT requested but {why}")
        log.info("nvme: %s at %s; using buffered I/O", why, root)
        return PosixBackend(direct=False), f"buffered ({why})"
    return PosixBackend(direct=True), "O_DIRECT"


def probe_direct(folder: str) -> tuple[bool, str]:
    """Whether ``folder``'s filesystem takes O_DIRECT writes; raises OSError if unwritable."""
    path = os.path.join(folder, ".kvstrata-probe")
    if not _O_DIRECT:
        return False, "O_DIRECT is not available on this platform"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False, "the filesystem refuses O_DIRECT"
    try:
        _pwrite_all(fd, [_staging()[:BLOCK]], 0)
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
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.close(fd)
    os.unlink(path)
