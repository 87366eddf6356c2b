"""The DRAM tier: one pre-touched arena in POSIX shared memory, optionally CUDA-pinned.

The arena is created once (``/dev/shm/{prefix}-{instance}-{n}``, where ``instance`` is a random
identity of this tier, never the PID: in a container the server is PID 1 after every restart, and
a client still mapping the previous ``kvstrata-1-0`` would read a dead arena), warmed (its pages
faulted in without a byte changed, :mod:`kvstrata.tiers._dram_warm`) so later copies run at
memcpy speed instead of page-fault speed, and carved by an
:class:`~kvstrata.tiers.alloc.OffsetAllocator` into 4096-aligned slots. Other processes map it
by name (``regions()``) and read a chunk at its ``handle()`` offset without a copy.

The chunk table (reserved vs committed slots, replace = publish new then free old) is
:class:`~kvstrata.tiers.arena.ArenaTier`'s. The memory of a replaced or deleted chunk may be
handed out again at once, so a ``view()`` stays valid only while the store keeps the chunk
pinned.

Everything here runs on the event loop without awaiting: a copy of a 32 MiB chunk is a few
milliseconds of memcpy. The warm-up is the exception: built with ``defer_pretouch`` (the
server does), the constructor only creates the segment and :meth:`DramTier.prepare` starts a
background task that warms it on a worker thread in 64 MiB steps, logging progress, and pins
it when done. The tier serves from the start: the warm-up never writes, so a chunk stored in a
page it has not reached yet is only slower to write (the page faults in then), never changed.
``info()`` shows the progress (``warming``, ``warmed_percent``, ``warm_method``).

Segments of processes killed before ``close()`` are reclaimed when the next tier with the same
prefix starts, and once more :data:`STALE_AFTER_SECONDS` later (:meth:`DramTier.reclaim_stale`,
called by the store: a server restarted at once after a kill -9 would otherwise keep its
predecessor's arena in ``/dev/shm`` until its own restart). Every server holds a shared
``flock`` on its own segment for its whole life, so a segment nobody holds is stale (this works
across PID namespaces sharing ``/dev/shm``).

Python 3.11's resource tracker would unlink the segment when *any* process that attached it
exits; the tier unregisters it after creating it and unlinks it itself on ``close()`` (or at
interpreter exit). Processes that attach by name must unregister it too (see
``tests/test_dram.py``).
"""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import logging
import os
import re
import time
import weakref
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.tiers import _cuda
from kvstrata.tiers._dram_warm import PageWarmer
from kvstrata.tiers.arena import ArenaTier, byte_view, new_instance_id
from kvstrata.tiers.base import Buffer, Region, TierUnavailable, register_tier

log = logging.getLogger(__name__)

PAGE = 4096
_TOUCH_STEP = 64 * 1024 * 1024
_arena_numbers = itertools.count()
STALE_AFTER_SECONDS = 5.0  # a younger segment may belong to a server still starting


@dataclass(frozen=True, slots=True)
class DramConfig:
    """Settings of the DRAM arena (``dram-*`` options)."""

    capacity: int = 1024**3
    name_prefix: str = "kvstrata"
    pin: str = "auto"  # auto | yes | no
    pin_quota: int = 0  # most bytes to pin; 0 = the whole arena
    region: str = "dram0"  # region id in handles and KV.REGIONS
    #: leave the warm-up and pinning to a background task started by ``await tier.prepare()``
    defer_pretouch: bool = False
    #: warm by reading one byte per page even where MADV_POPULATE_WRITE works (tests)
    warm_by_reading: bool = False

    @classmethod
    def from_config(cls, cfg: Any) -> DramConfig:
        """Build from a :class:`kvstrata.config.Config`."""
        return cls(
            capacity=cfg.dram_capacity, pin=cfg.dram_pin, pin_quota=cfg.dram_pin_quota,
            defer_pretouch=True,
        )  # fmt: skip


def _unlink_shm(name: str) -> None:
    """Unlink ``/dev/shm/{name}`` (attaching registers it with the tracker, unlink unregisters)."""
    try:
        shm = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return
    shm.close()
    shm.unlink()


def _hold(name: str, shm_dir: str = "/dev/shm") -> int:
    """Take the shared lock that marks our arena as alive; -1 when it cannot be taken."""
    try:
        fd = os.open(os.path.join(shm_dir, name), os.O_RDONLY)
    except OSError:
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError:
        os.close(fd)
        return -1
    return fd


def _held(path: str) -> bool:
    """Whether a live process holds the arena's lock (every server holds a shared flock on its
    own arena for its whole life; the kernel drops it when the process dies, whatever PID
    namespace it ran in)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def reclaim_stale_arenas(
    prefix: str, shm_dir: str = "/dev/shm", min_age: float = STALE_AFTER_SECONDS
) -> list[str]:
    """Unlink ``{prefix}-{instance}-{n}`` segments (and the ``{prefix}-{pid}-{n}`` ones of older
    versions) that no live server holds (killed without close()). A segment younger than
    ``min_age`` seconds is left alone: its server may not have taken its lock yet."""
    pattern = re.compile(rf"{re.escape(prefix)}-([0-9a-f]{{16}}|\d+)-\d+")
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    removed = []
    now = time.time()
    for name in names:
        if not pattern.fullmatch(name):
            continue
        path = os.path.join(shm_dir, name)
        try:
            young = now - os.stat(path).st_mtime < min_age
        except OSError:
            continue
        if young or _held(path):
            continue
        try:
            os.unlink(path)
        except OSError:
            continue
        removed.append(name)
        log.warning("dram: removed stale arena %s (no live server holds it)", name)
    return removed


class DramTier(ArenaTier):
    """Chunks in one shared-memory arena; see the module docstring."""

    name = "dram"

    def __init__(self, config: DramConfig) -> None:
        if config.capacity <= 0:
            raise TierUnavailable(f"dram capacity must be positive, got {config.capacity}")
        if config.pin not in ("auto", "yes", "no"):
            raise TierUnavailable(f"dram pin must be auto, yes or no, got {config.pin!r}")
        self.config = config
        size = (config.capacity + PAGE - 1) // PAGE * PAGE
        self.reclaimed = reclaim_stale_arenas(config.name_prefix)
        instance = new_instance_id()
        shm_name = f"{config.name_prefix}-{instance}-{next(_arena_numbers)}"
        try:
            self._shm = shared_memory.SharedMemory(name=shm_name, create=True, size=size)
        except OSError as exc:
            raise TierUnavailable(
                f"cannot create shared memory {shm_name} ({size} B): {exc}"
            ) from exc
        resource_tracker.unregister(f"/{self._shm.name}", "shared_memory")
        self._lock_fd = _hold(self._shm.name)
        self._finalizer = weakref.finalize(self, _unlink_shm, self._shm.name)
        buf = self._shm.buf
        assert buf is not None
        self._buf: memoryview = buf
        super().__init__(size, config.region, instance)
        self.touch_seconds = 0.0  # how long the warm-up took (0 until it is done)
        self.touched = 0  # bytes warmed so far, from offset 0 up
        self.warm_error = ""  # why the warm-up stopped early ("" when it did not)
        self._warmer = PageWarmer(buf, force_read=config.warm_by_reading)
        self._warm_task: asyncio.Task[None] | None = None
        self._pin_ptr = 0
        self.pinned, self.pin_reason = 0, "not prepared yet"
        if not config.defer_pretouch:
            started = time.perf_counter()
            for start in range(0, size, _TOUCH_STEP):
                self._touch_range(start, min(size, start + _TOUCH_STEP))
            self.touch_seconds = time.perf_counter() - started
            self.pinned, self.pin_reason = self._pin()

    # -- arena setup --------------------------------------------------------------------

    def _touch_range(self, start: int, end: int) -> None:
        """Fault ``[start, end)`` in without changing a byte (worker thread, GIL released)."""
        self._warmer.warm(start, end)
        self.touched = end

    @property
    def warming(self) -> bool:
        """The background warm-up is still running."""
        return self._warm_task is not None and not self._warm_task.done()

    async def prepare(self) -> None:
        """Start warming (then pinning) a tier built with ``defer_pretouch`` in the background
        and return at once: the tier serves meanwhile (see the module docstring)."""
        if not self.config.defer_pretouch or self.touch_seconds or self._warm_task is not None:
            return
        self._warm_task = asyncio.get_running_loop().create_task(self._warm(), name="dram warm")

    async def wait_warm(self) -> None:
        """Until the background warm-up (and pinning) is over (benchmarks, tests)."""
        if self._warm_task is not None:
            await asyncio.wait([self._warm_task])

    async def _warm(self) -> None:
        """The warm-up: 64 MiB steps on a worker thread, a progress line about every second.
        Cancelling it waits for the step in flight (the segment must not be closed under a
        thread reading it). A failure is logged and shown in ``info()``, and ends the warm-up
        only: pages not reached fault in when first written."""
        loop = asyncio.get_running_loop()
        size = self._alloc.capacity
        started = last_log = time.perf_counter()
        for start in range(0, size, _TOUCH_STEP):
            step = loop.run_in_executor(
                None, self._touch_range, start, min(size, start + _TOUCH_STEP)
            )
            try:
                await asyncio.shield(step)
            except asyncio.CancelledError:
                await asyncio.wait([step])
                raise
            except Exception as exc:  # OSError: the segment cannot be backed
                self.warm_error = str(exc)
                log.error("dram: warming the arena %s stopped at %s of %s: %s (is /dev/shm "
                          "large enough? df -h /dev/shm)", self._shm.name,
                          _fmt_bytes(self.touched), _fmt_bytes(size), exc)  # fmt: skip
                break
            now = time.perf_counter()
            if now - last_log >= 1.0:
                last_log = now
                log.info("dram: warmed %d%% of %s (%.1f s, serving meanwhile)",
                         100 * self.touched // size, _fmt_bytes(size), now - started)  # fmt: skip
        self.touch_seconds = max(time.perf_counter() - started, 1e-9)
        pin = loop.run_in_executor(None, self._pin)
        try:
            self.pinned, self.pin_reason = await asyncio.shield(pin)
        except asyncio.CancelledError:
            await asyncio.wait([pin])  # close() must see the registration to undo it
            self.pinned, self.pin_reason = pin.result()
            raise
        log.info("dram: arena of %s warmed in %.2f s (%s)", _fmt_bytes(size),
                 self.touch_seconds, self._warmer.method)  # fmt: skip

    def _pin(self) -> tuple[int, str]:
        if self.config.pin == "no":
            return 0, "disabled (dram-pin no)"
        reason = _cuda.cuda_unavailable_reason()
        if reason is None:
            quota = self.config.pin_quota or self._alloc.capacity
            size = min(quota, self._alloc.capacity) // PAGE * PAGE
            ptr = int(np.frombuffer(self._buf, dtype=np.uint8).ctypes.data)
            failure = _cuda.host_register(ptr, size)
            if failure is None:
                self._pin_ptr = ptr
                return size, "cudaHostRegister"
            reason = failure
        level = logging.WARNING if self.config.pin == "yes" else logging.INFO
        log.log(level, "dram arena %s not pinned: %s", self._shm.name, reason)
        return 0, reason

    def reclaim_stale(self) -> list[str]:
        """Unlink the stale arenas of this prefix found now (never our own: we hold it)."""
        found = reclaim_stale_arenas(self.config.name_prefix)
        self.reclaimed += found
        return found

    @property
    def arena_name(self) -> str:
        return self._shm.name

    # -- synchronous zero-copy primitives -----------------------------------------------

    def reserve(self, key: ChunkKey, nbytes: int) -> memoryview:
        offset = self._reserve(key, nbytes)
        return self._buf[offset : offset + nbytes]

    def view(self, key: ChunkKey) -> memoryview:
        slot = self._lookup(key)
        self.stats.hits += 1
        self.stats.bytes_out += slot.length
        return self._buf[slot.offset : slot.offset + slot.length]

    def regions(self) -> list[Region]:
        return [
            Region(
                self.region_name,
                "shm",
                self._alloc.capacity,
                self._shm.name,
                -1,
                instance=self.instance,
            )
        ]

    # -- async contract -----------------------------------------------------------------

    async def put(self, meta: ChunkMeta, data: Buffer) -> None:
        self._check_open()
        src = byte_view(data)
        if src.nbytes != meta.size:
            raise ValueError(f"payload is {src.nbytes} bytes, meta says {meta.size}")
        started = time.perf_counter()
        offset = self._allocate(meta.size)
        self._buf[offset : offset + meta.size] = src
        self.stats.seconds_in += time.perf_counter() - started
        self._publish(meta, offset)

    async def get(self, key: ChunkKey, out: memoryview) -> ChunkMeta:
        slot = self._lookup(key)
        dst = byte_view(out)
        if dst.nbytes < slot.length:
            raise ValueError(f"buffer of {dst.nbytes} bytes for a {slot.length}-byte chunk")
        started = time.perf_counter()
        dst[: slot.length] = self._buf[slot.offset : slot.offset + slot.length]
        self.stats.seconds_out += time.perf_counter() - started
        self.stats.hits += 1
        self.stats.bytes_out += slot.length
        assert slot.meta is not None
        return slot.meta

    def info(self) -> dict[str, Any]:
        return {
            "arena": self._shm.name,
            **self._table_info(),
            "pinned": self.pinned,
            "pin_reason": self.pin_reason,
            "pretouch_seconds": round(self.touch_seconds, 3),
            "warming": int(self.warming),
            "warmed_percent": 100 * self.touched // max(1, self._alloc.capacity),
            "warm_method": self._warmer.method,
            **({"warm_error": self.warm_error} if self.warm_error else {}),
        }

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._warm_task is not None:
            self._warm_task.cancel()
            await asyncio.wait([self._warm_task])
        if self._pin_ptr:
            _cuda.host_unregister(self._pin_ptr)
            self._pin_ptr = 0
        self._clear_table()
        self._finalizer.detach()
        name = self._shm.name
        try:
            self._shm.close()
        except BufferError:
            # Views are still exported: drop our reference to the mapping (private attribute of
            # SharedMemory) so it is unmapped with the last view, and close the descriptor.
            log.warning("dram arena %s: views still held; unmapped when they are freed", name)
            setattr(self._shm, "_mmap", None)  # noqa: B010
            self._shm.close()
        _unlink_shm(name)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def _fmt_bytes(n: int) -> str:
    return f"{n / 1024**3:.1f} GiB" if n >= 1024**3 else f"{n / 1024**2:.0f} MiB"


# Registered by call rather than as a decorator so that type checkers keep the class type.
register_tier("dram")(DramTier)
