"""When an NVMe chunk write counts as done: the ``nvme-fsync`` policies and the group commit.

Integrity never depends on the policy: header and payload carry checksums, so a torn, short or
zero-filled file is found at read (or by ``scan()``) and quarantined — a miss, never wrong
bytes. The policy only decides which acknowledged chunks survive a **power loss** (kill -9 loses
nothing under any policy: O_DIRECT writes and the page cache outlive the process).

- ``always``: write, rename, ``fsync`` the file and its shard folder, then acknowledge. One
  journal commit per chunk (the folder fsync finds the rename already committed on ext4/xfs).
- ``batch``: write, rename, then wait for the next group sync (:class:`GroupSync`): one thread
  commits the journal once for every write renamed before its pass, and only then are they
  acknowledged. Concurrent writes share one journal commit and one device flush instead of
  paying them each; the I/O threads do not wait for it, so the disk stays busy meanwhile.
  Relies on a journaling filesystem that commits in order (ext4, xfs); elsewhere use
  ``always``.
- ``never``: write, rename, acknowledge. Survives kill -9; after a power loss recent chunks may
  be missing or quarantined (still never wrong bytes).

Deletes follow the policy too (``always``: folder fsync; ``batch``: group sync; ``never``:
none); a deleted chunk that reappears after a power loss is an intact, correct chunk.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, InvalidStateError

from kvstrata.tiers.base import TierIOError

POLICIES = ("always", "batch", "never")
SYNC_MARKER = ".kvstrata-sync"  # in the tier folder; its timestamp changes at every group sync


class GroupSync:
    """Group commit: a writer submits after its rename (with the new file's descriptor) and
    waits on the future; one thread makes everything submitted before its pass durable, then
    resolves those futures and closes the files.

    A pass changes the timestamps of a marker file and fsyncs it: a journaling filesystem
    (ext4's jbd2, xfs's log) commits in order, so committing the marker's change commits every
    rename, size and extent change made before it, and the commit's cache flush makes the
    O_DIRECT payloads (already on the device when the write returned) durable too. One journal
    commit and one flush per group; fsyncing each file would add one device flush per file.
    With buffered writes (``per_file``) payloads may still be in the page cache, so every file
    is fsynced as well. No timer: a pass starts as soon as one writer waits, and writers arriving
    during it are served by the next, so groups grow with the load and an idle tier adds no
    latency. ``syncs`` (passes) and ``synced`` (writes covered) feed INFO.
    """

    def __init__(self, marker: str, per_file: bool) -> None:
        self._marker = os.open(marker, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._per_file = per_file
        self._cond = threading.Condition()
        self._waiting: list[tuple[int, Future[None]]] = []
        self._closing = False
        self.syncs = 0
        self.synced = 0
        self._thread = threading.Thread(target=self._loop, name="kvstrata-nvme-sync", daemon=True)
        self._thread.start()

    @property
    def per_file(self) -> bool:
        """Whether each submitted file is fsynced too (buffered writes, kvikio)."""
        return self._per_file

    def submit(self, file_fd: int) -> Future[None]:
        """A future resolved once every change made before this call is durable; ``file_fd``
        (-1: none) is the new file's descriptor, closed by this object in any case. Raises
        :class:`TierIOError` once closing (a write finishing during shutdown fails like any
        other tier I/O failure)."""
        done: Future[None] = Future()
        with self._cond:
            if self._closing:
                if file_fd >= 0:
                    os.close(file_fd)
                raise TierIOError("nvme: group sync is closed")
            self._waiting.append((file_fd, done))
            self._cond.notify()
        return done

    def close(self) -> None:
        """Serve the writers still waiting, then stop the thread."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify()
        self._thread.join()
        os.close(self._marker)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closing:
                    self._cond.wait()
                if not self._waiting:
                    return
                group, self._waiting = self._waiting, []
            error = self._sync(group)
            self.syncs += 1
            self.synced += len(group)
            for file_fd, done in group:
                if file_fd >= 0:
                    os.close(file_fd)
                try:
                    if error is None:
                        done.set_result(None)
                    else:
                        done.set_exception(error)
                except InvalidStateError:  # the writer gave up waiting (cancelled): nothing to tell
                    pass

    def _sync(self, group: list[tuple[int, Future[None]]]) -> OSError | None:
        """One pass; the first error fails the whole group."""
        try:
            if self._per_file:
                for file_fd, _ in group:
                    if file_fd >= 0:
                        os.fsync(file_fd)
            now = time.time_ns()
            os.utime(self._marker, ns=(now, now))
            os.fsync(self._marker)
        except OSError as exc:
            return exc
        return None
