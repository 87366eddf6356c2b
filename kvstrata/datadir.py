"""The data folder: created at start-up and held by one server at a time.

Two servers on one ``data-dir`` (the default ``./kvstrata-data`` makes that easy: start two in
the same directory) would write into the same NVMe slab slots and lose each other's chunks.
So a server takes an exclusive ``flock`` on :data:`LOCK_NAME` inside the folder before it
touches anything there, and holds it for its whole life; a second server gets
:class:`FolderInUse` (its message names the folder and the holder's pid) and does not start.

``flock`` belongs to the open file, so it goes with the process however the process ends
(``kill -9`` included): a lock file left behind never blocks a restart, and the file is never
deleted (deleting it would let two servers lock two different files of one name). The pid
written into it is only for the message. The same lock is taken on the NVMe tier's folder
(``nvme-path``, by default ``DATA-DIR/nvme``), which the tier's start-up scan leaves alone.
No imports from the rest of kvstrata: the server takes the lock, the NVMe tier names it.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_NAME = ".kvstrata-lock"


def _not_a_folder(folder: Path) -> Path | None:
    """``folder`` or the nearest of its parents that exists but is not a folder (a file)."""
    for candidate in (folder, *folder.parents):
        if candidate.exists() or candidate.is_symlink():
            return None if candidate.is_dir() else candidate
    return None


class FolderInUse(OSError):
    """Another live process holds the folder's lock."""


def ensure_folder(path: str | Path, what: str = "data-dir", mode: int = 0o777) -> Path:
    """Create the folder (and its parents); an OSError naming ``what`` when that fails or it
    is not writable."""
    folder = Path(path)
    try:
        folder.mkdir(mode=mode, parents=True, exist_ok=True)
    except OSError as exc:
        blocker = _not_a_folder(folder)
        if blocker == folder:
            raise OSError(f"{what} {folder} is a file, not a folder") from None
        if blocker is not None:
            raise OSError(
                f"cannot create {what} {folder}: {blocker} is a file, not a folder"
            ) from None
        raise OSError(f"cannot create {what} {folder}: {exc.strerror or exc}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OSError(f"{what} {folder} is not writable")
    return folder


class FolderLock:
    """An exclusive lock on one folder, held until :meth:`release` or the process's end."""

    def __init__(self, folder: Path, fd: int) -> None:
        self.folder = folder
        self._fd = fd

    @classmethod
    def acquire(cls, folder: Path, what: str = "data-dir") -> FolderLock:
        """Lock ``folder`` (which exists) or raise :class:`FolderInUse` / OSError, each with
        one line naming ``what`` and the folder."""
        path = folder / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise OSError(f"cannot open the lock file {path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise FolderInUse(
                f"{what} {folder.resolve()} is in use by another kvstrata server ({holder}); "
                f"stop it or give this one another {what}"
            ) from None
        except OSError as exc:  # a file system without flock (some network mounts)
            os.close(fd)
            raise OSError(
                f"cannot lock {what} {folder.resolve()} ({path.name}): {exc.strerror or exc}"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(folder, fd)

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def release(self) -> None:
        """Unlock (idempotent); the file stays, emptied of the pid."""
        fd, self._fd = self._fd, -1
        if fd < 0:
            return
        try:
            os.ftruncate(fd, 0)  # still locked here: no other server has written its pid yet
        except OSError:
            pass
        os.close(fd)


def _holder(fd: int) -> str:
    """``pid N`` from the lock file, or a phrase when it has none yet."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return f"pid {text}" if text.isdigit() else "pid not written yet"


def lock_folders(data_dir: str, nvme_dir: Path | None) -> list[FolderLock]:
    """Create and lock the data folder, and ``nvme_dir`` (the NVMe tier's folder, None when
    the tier is off) as well unless it is the same folder: two servers with different data
    folders may still name one ``nvme-path``. The NVMe folder is created only where its
    parent exists, private (0700) as the tier makes it; otherwise the tier says what is
    wrong with it."""
    folder = ensure_folder(data_dir)
    locks = [FolderLock.acquire(folder)]
    try:
        if nvme_dir is not None and not _same(nvme_dir, folder):
            if not nvme_dir.exists() and nvme_dir.parent.is_dir():
                ensure_folder(nvme_dir, "nvme-path", mode=0o700)
            if nvme_dir.is_dir():
                locks.append(FolderLock.acquire(nvme_dir, "nvme-path"))
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False
