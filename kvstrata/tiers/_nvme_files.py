"""Blocking work of the NVMe tier, run on its thread pool: write, read and delete chunk files.

A write creates a temporary file in the chunk's shard folder, writes header and payload
through the backend and renames it over the final name; the ``nvme-fsync`` policy
(``_nvme_sync``) decides what is synced before the chunk is acknowledged. A read checks the
header and the payload checksum and quarantines a file that fails (:class:`Corrupt`) — only
if that file still has the chunk's name: a put may have renamed a good one over it meanwhile.
``OSError`` goes up to the tier, which counts it and raises ``TierIOError``.
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import NoReturn

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.tiers import _nvme_scan
from kvstrata.tiers._nvme_format import (
    TMP_SUFFIX,
    BadHeader,
    WriteClock,
    chunk_digest,
    decode_header,
    encode_header,
)
from kvstrata.tiers._nvme_io import Backend, FileId
from kvstrata.tiers.base import ChunkMissing, IntegrityError
from kvstrata.tiers.checksum import checksum

_tmp_numbers = itertools.count()


class Corrupt(Exception):
    """A file failed verification on read; the message says why. ``quarantined``: whether
    it was moved to quarantine (False when another file had taken its name, or it was gone)."""

    def __init__(self, reason: str, quarantined: bool) -> None:
        super().__init__(reason)
        self.quarantined = quarantined


class ChunkFiles:
    """The chunk files under ``root``; ``in_flight`` names the temp files being written."""

    def __init__(
        self, root: str, backend: Backend, fsync: str, clock: WriteClock | None = None
    ) -> None:
        self.root = root
        self.clock = clock or WriteClock()
        self.backend = backend
        self.fsync = fsync
        self.in_flight: set[str] = set()
        self._dir_fds: dict[str, int] = {}
        self._dir_lock = threading.Lock()  # guards _dir_fds only, never held during I/O
        # Held around a rename onto a chunk name and around quarantine's check-then-move, so
        # that quarantine moves the file it checked and never a file renamed in between.
        self._name_lock = threading.Lock()

    def path(self, key: ChunkKey) -> tuple[str, str]:
        digest = chunk_digest(key)
        return os.path.join(self.root, digest[:2]), f"{digest}.kvc"

    def write(self, meta: ChunkMeta, payload: memoryview) -> tuple[ChunkMeta, int]:
        """Write and rename; under ``batch`` the new file's descriptor is returned open for the
        group sync (-1 otherwise)."""
        csum = checksum(payload)
        if meta.checksum and meta.checksum != csum:
            raise IntegrityError(f"payload of {meta.key.hex} does not match its checksum")
        stored = ChunkMeta(meta.key, meta.parent, meta.tokens, meta.size, csum, meta.codec)
        header = encode_header(stored, csum, self.clock.now())
        folder, name = self.path(meta.key)
        final = os.path.join(folder, name)
        tmp = os.path.join(folder, f".{name}.{os.getpid()}.{next(_tmp_numbers)}{TMP_SUFFIX}")
        self.in_flight.add(tmp)
        try:
            fd = self.backend.write_file(tmp, header, payload)
            try:
                with self._name_lock:
                    os.replace(tmp, final)
            except BaseException:
                os.close(fd)
                raise
        except BaseException:
            unlink_quietly(tmp)
            raise
        finally:
            self.in_flight.discard(tmp)
        # Renamed before the fsyncs: one journal commit covers data, size and name. A power
        # loss before they finish leaves a torn file under the final name, which the checksums
        # catch (quarantine, miss); the chunk is acknowledged only after the syncs.
        if self.fsync == "batch":
            return stored, fd
        try:
            if self.fsync == "always":
                os.fsync(fd)
                os.fsync(self.dir_fd(folder))
        except BaseException:
            unlink_quietly(final)
            raise
        finally:
            os.close(fd)
        return stored, -1

    def read(self, key: ChunkKey, out: memoryview) -> ChunkMeta:
        folder, name = self.path(key)
        path = os.path.join(folder, name)
        block, got, ident = self.backend.read_file(path, out)
        try:
            meta = decode_header(block).meta
        except BadHeader as exc:
            self._quarantine(path, ident, str(exc))
        if meta.key != key:
            self._quarantine(path, ident, "header names another chunk")
        if meta.size > len(out):
            # A concurrent replacement wrote a larger chunk after our index lookup.
            raise ChunkMissing(key)
        if got < meta.size:
            self._quarantine(path, ident, f"truncated payload ({got} of {meta.size} bytes)")
        if checksum(out[: meta.size]) != meta.checksum:
            self._quarantine(path, ident, "payload checksum mismatch")
        return meta

    def _quarantine(self, path: str, ident: FileId, reason: str) -> NoReturn:
        """Quarantine ``path`` if it still names the file read (``ident``); raise Corrupt."""
        with self._name_lock:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                moved = False
            else:
                same = (st.st_dev, st.st_ino) == ident
                moved = same and _nvme_scan.quarantine(self.root, path, reason)
        raise Corrupt(reason, moved)

    def delete(self, key: ChunkKey) -> None:
        folder, name = self.path(key)
        try:
            os.unlink(os.path.join(folder, name))
        except FileNotFoundError:
            return
        if self.fsync == "always":
            os.fsync(self.dir_fd(folder))

    def dir_fd(self, folder: str) -> int:
        """A descriptor of ``folder`` kept open until close (no open per fsync)."""
        fd = self._dir_fds.get(folder)
        if fd is None:
            with self._dir_lock:
                fd = self._dir_fds.get(folder)
                if fd is None:
                    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                    self._dir_fds[folder] = fd
        return fd

    def close(self) -> None:
        with self._dir_lock:
            for fd in self._dir_fds.values():
                os.close(fd)
            self._dir_fds.clear()


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
