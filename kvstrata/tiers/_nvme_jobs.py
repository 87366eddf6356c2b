"""The NVMe tier's pool jobs: blocking file work run on its bounded thread pool.

A mixin of :class:`~kvstrata.tiers.nvme.NvmeTier`: ``_run`` submits one job and maps an
``OSError`` to a counted, logged :class:`TierIOError` (``enospc``/``eio``/``eacces`` in the
tier's stats, ``last_error``); a caller cancelled meanwhile (a shutdown) leaves the job to run
on, its outcome consumed, and can ask for queued clean-up to run too or for the result of a
write that still succeeds to be undone.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any

from kvstrata.tiers._nvme_files import Corrupt, unlink_quietly
from kvstrata.tiers.base import IntegrityError, TierIOError, TierStats, TierUnavailable

log = logging.getLogger("kvstrata.tiers.nvme")  # the tier's logger, as before the split


class NvmeJobs:
    """Mixin of ``NvmeTier``: its jobs on the pool and their errors."""

    # state owned by NvmeTier
    stats: TierStats
    last_error: str
    _pool: ThreadPoolExecutor
    _closed: bool

    if TYPE_CHECKING:  # NvmeTier's (a stub here would shadow it)

        def _check_open(self) -> None: ...

    async def _run(
        self, fn: Any, *args: Any, finish: bool = False, undo: Callable[[Any], None] | None = None
    ) -> Any:
        """Run ``fn`` on the pool; OSError becomes a counted, logged TierIOError.

        When the caller is cancelled (a shutdown cancelling background work) a job already
        running goes on; ``finish``: one still queued runs too (invalidations and deletes: the
        disk must end up agreeing with the index, or a restart brings a deleted chunk back);
        ``undo`` gets the result of a job that still succeeds (a slot written for a put that
        did not happen, invalidated then)."""
        self._check_open()  # close() shuts the pool down: a closed tier raises TierUnavailable
        job = self._pool.submit(fn, *args)
        waited = asyncio.wrap_future(job)
        try:
            return await (asyncio.shield(waited) if finish else waited)
        except asyncio.CancelledError:
            waited.add_done_callback(_retrieved)
            if undo is not None:
                job.add_done_callback(partial(_undo, undo))
            raise
        except (FileNotFoundError, Corrupt, IntegrityError):
            raise
        except OSError as exc:
            raise self._io_error(getattr(fn, "__name__", str(fn)), exc) from exc

    async def _run_quietly(self, fn: Any, *args: Any) -> None:
        """Run clean-up work whose failure is counted and logged (``_run``) but not raised."""
        try:
            await self._run(fn, *args, finish=True)
        except (TierIOError, TierUnavailable):
            pass

    async def _unlink(self, path: str) -> None:
        """Remove ``path`` on the pool, or right here once the tier is closed (no pool)."""
        if self._closed:
            unlink_quietly(path)
        else:
            await asyncio.get_running_loop().run_in_executor(self._pool, unlink_quietly, path)

    def _io_error(self, what: str, exc: OSError) -> TierIOError:
        self.stats.errors += 1
        kind = {errno.ENOSPC: "enospc", errno.EDQUOT: "enospc", errno.EIO: "eio",
                errno.EACCES: "eacces"}  # fmt: skip
        name = kind.get(exc.errno or 0, "eio" if exc.errno is None else "")
        if name:
            self.stats.extra[name] += 1
        self.last_error = f"{errno.errorcode.get(exc.errno or 0, 'EIO')}: {exc.strerror}"
        log.warning("nvme: %s failed: %s", what, self.last_error)
        return TierIOError(f"nvme: {self.last_error}")


def _retrieved(waited: asyncio.Future[Any]) -> None:
    """Consume the outcome of a job its caller stopped waiting for (no "never retrieved")."""
    if not waited.cancelled():
        waited.exception()


def _undo(undo: Callable[[Any], None], job: Future[Any]) -> None:
    """Run ``undo`` on the result of a job whose caller was cancelled, if it succeeded."""
    if job.cancelled() or job.exception() is not None:
        return
    try:
        undo(job.result())
    except OSError as exc:
        log.warning("nvme: undoing a cancelled write failed: %s", exc)
