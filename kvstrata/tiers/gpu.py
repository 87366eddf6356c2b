"""The GPU tier: one pool of device memory, carved like the DRAM arena, shared by CUDA IPC.

At start the tier allocates ``gpu-capacity`` bytes on ``gpu-device`` once (``cudaMalloc``
through :mod:`~kvstrata.tiers.gpu_runtime`, see there why not torch's caching allocator),
exports the pool once with ``cudaIpcGetMemHandle`` and hands out 4096-aligned slots with the
same :class:`~kvstrata.tiers.alloc.OffsetAllocator` as the DRAM arena. ``regions()`` lists the
pool as kind ``cuda`` (device, PCI bus id, size, hex IPC handle, instance);
``handle()``/``reserved_handle()`` give (region, offset, length, instance) inside it, which a
client opens once per process and views as a torch tensor with no copy
(``kvstrata.clients.handles``).

Device memory has no host ``memoryview``: ``view()``/``reserve()`` raise :class:`NoHostView`
(they work over the host stand-in used by CPU tests). The GPU-native forms are
``reserve_handle()`` (a writable handle for KV.RESERVE), ``tensor()``/``reserved_tensor()``
(torch views on the device), and the async moves: ``put``/``get`` copy from/to a host buffer
(the pinned DRAM arena: an asynchronous DMA on the tier's own stream), ``put_from`` fills a new
slot with any blocking function (kvikio reading NVMe straight into the slot), ``read_with``
lends a committed slot to one (kvikio writing it out).

Copies run on a small executor (``copy-threads``), never on the event loop. A slot being read is
held (:meth:`~kvstrata.tiers.arena.ArenaTier.hold`) until the copy's thread ends, also when the
caller was cancelled meanwhile: a delete or replacement during a copy defers the free, and a
cancelled fill frees its slot only once its thread has stopped writing it. The pool's
``instance`` identity (random per start) is in every handle and in ``regions()``, next to the
IPC handle. The chunk table (reserved vs committed, replace = publish new then free old) is
:class:`~kvstrata.tiers.arena.ArenaTier`'s, shared with the DRAM tier.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.tiers.arena import ArenaTier, Slot, byte_view
from kvstrata.tiers.base import Buffer, Handle, Region, TierError, TierUnavailable, register_tier
from kvstrata.tiers.gpu_memory import CudaMemory, DeviceMemory, NoHostView
from kvstrata.tiers.gpu_runtime import CudaCallError, load_runtime
from kvstrata.tiers.gpu_select import require_gpu

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["GpuConfig", "GpuTier", "NoHostView", "open_device_memory"]


@dataclass(frozen=True, slots=True)
class GpuConfig:
    """Settings of the GPU pool (``gpu-*`` options)."""

    device: int = 0
    capacity: int = 0  # 0 = no GPU tier
    copy_threads: int = 2  # concurrent host<->device copies (one stream each)
    region: str = ""  # region id in handles; default "gpu{device}"

    @classmethod
    def from_config(cls, cfg: Any) -> GpuConfig:
        """Build from a :class:`kvstrata.config.Config`."""
        return cls(
            device=cfg.gpu_device, capacity=cfg.gpu_capacity, copy_threads=cfg.gpu_copy_threads
        )

    @property
    def region_name(self) -> str:
        return self.region or f"gpu{self.device}"


def open_device_memory(config: GpuConfig) -> DeviceMemory:
    """The CUDA pool for ``config``; raises TierUnavailable with the reason when impossible."""
    found = require_gpu(config.capacity, config.device)
    size = config.capacity - config.capacity % 4096
    try:
        memory = CudaMemory(load_runtime(), config.device, size)
    except CudaCallError as exc:
        raise TierUnavailable(
            f"gpu: cannot allocate a {size}-byte pool on cuda:{config.device}: {exc}"
        ) from exc
    log.info("gpu pool: %d bytes on %s through %s", size, found, memory.backend)
    return memory


class GpuTier(ArenaTier):
    """Chunks in one device pool; see the module docstring.

    ``memory`` replaces the CUDA pool (tests pass a :class:`HostMemory`); by default the pool
    is opened on ``config.device`` and start-up fails with :class:`TierUnavailable` without CUDA.
    """

    name = "gpu"

    def __init__(self, config: GpuConfig, memory: DeviceMemory | None = None) -> None:
        if config.capacity <= 0:
            raise TierUnavailable("gpu tier disabled: gpu-capacity is 0")
        if config.copy_threads < 1:
            raise TierUnavailable(f"gpu copy_threads must be >= 1, got {config.copy_threads}")
        self.config = config
        self._mem = memory if memory is not None else open_device_memory(config)
        super().__init__(min(self._mem.size, config.capacity), config.region_name)
        try:
            self._ipc_hex = self._mem.ipc_handle().hex()  # exported once, at start
        except CudaCallError as exc:
            self._mem.close()
            raise TierUnavailable(f"gpu: cudaIpcGetMemHandle failed: {exc}") from exc
        self._pool = ThreadPoolExecutor(config.copy_threads, thread_name_prefix="kvstrata-gpu")

    @property
    def memory(self) -> DeviceMemory:
        return self._mem

    # -- synchronous zero-copy primitives -----------------------------------------------

    def reserve_handle(self, key: ChunkKey, nbytes: int) -> Handle:
        """Reserve an invisible slot (KV.RESERVE into the GPU); commit()/abort() end it."""
        return Handle(self.region_name, self._reserve(key, nbytes), nbytes, self.instance)

    def reserve(self, key: ChunkKey, nbytes: int) -> memoryview:
        if not self._mem.host_addressable:
            raise NoHostView("gpu: reserve() has no host view; use reserve_handle()")
        handle = self.reserve_handle(key, nbytes)
        return self._mem.host_view(handle.offset, nbytes)

    def view(self, key: ChunkKey) -> memoryview:
        slot = self._lookup(key)
        return self._mem.host_view(slot.offset, slot.length)

    def tensor(self, key: ChunkKey) -> Any:
        """A torch uint8 tensor over the committed chunk, on the pool's device (no copy).

        The tier copies on its own non-blocking streams: work queued on such a tensor must be
        finished (``torch.cuda.synchronize()`` or an event) before the chunk is committed,
        read with ``get`` or deleted."""
        slot = self._lookup(key)
        return self._mem.tensor(slot.offset, slot.length)

    def reserved_tensor(self, key: ChunkKey) -> Any:
        """A torch uint8 tensor over a reserved slot, to fill on the device before commit()."""
        slot = self._reserved_slot(key)
        return self._mem.tensor(slot.offset, slot.length)

    def regions(self) -> list[Region]:
        return [
            Region(self.region_name, "cuda", self._alloc.capacity, self._ipc_hex, self._mem.device,
                   self._mem.pci_bus_id, self.instance)
        ]  # fmt: skip

    # -- async contract -----------------------------------------------------------------

    async def put(self, meta: ChunkMeta, data: Buffer) -> None:
        """Copy a host buffer into a new slot and publish it (host → device)."""
        src = byte_view(data)
        if src.nbytes != meta.size:
            raise ValueError(f"payload is {src.nbytes} bytes, meta says {meta.size}")
        await self.put_from(meta, lambda mem, offset: mem.to_device(offset, src))

    async def put_from(self, meta: ChunkMeta, fill: Callable[[DeviceMemory, int], None]) -> None:
        """Allocate a slot for ``meta``, run ``fill(memory, offset)`` on the copy executor to
        write its bytes, then publish it; the slot is freed if ``fill`` raises."""
        self._check_open()
        offset = self._allocate(meta.size)
        started = time.perf_counter()
        try:
            copy = self._submit(fill, self._mem, offset)
        except BaseException:  # the executor refused it (shut down): nothing runs on the slot
            self._free(offset)
            raise
        try:
            await self._wait(copy)
        except BaseException:  # also a cancellation while the thread still writes the slot
            _when_done(copy, lambda: self._free_unless_closed(offset))
            raise
        self.stats.seconds_in += time.perf_counter() - started
        if self._closed:
            raise TierUnavailable("gpu tier closed during a copy")
        self._publish(meta, offset)

    async def get(self, key: ChunkKey, out: memoryview) -> ChunkMeta:
        """Copy a committed chunk into a host buffer (device → host)."""
        dst = byte_view(out)
        slot = self._lookup(key)
        if dst.nbytes < slot.length:
            raise ValueError(f"buffer of {dst.nbytes} bytes for a {slot.length}-byte chunk")
        n = slot.length
        meta = await self.read_with(key, lambda mem, offset: mem.to_host(offset, dst[:n]))
        self.stats.hits += 1
        self.stats.bytes_out += n
        return meta

    async def read_with(self, key: ChunkKey, use: Callable[[DeviceMemory, int], T]) -> ChunkMeta:
        """Run ``use(memory, offset)`` on the copy executor over the committed chunk; its slot
        is not reused until ``use`` returns, even if the chunk is deleted meanwhile."""
        slot = self._lookup(key)
        await self._read_slot(slot, use)
        assert slot.meta is not None
        return slot.meta

    async def get_reserved(self, key: ChunkKey, out: memoryview) -> None:
        """Copy a reserved, not yet committed slot into a host buffer (device → host).

        KV.COMMIT of a chunk written into the GPU uses it to checksum the bytes (and keep a
        DRAM copy) before :meth:`commit`; an ``abort`` during the copy defers the free."""
        dst = byte_view(out)
        slot = self._reserved_slot(key)
        if dst.nbytes < slot.length:
            raise ValueError(f"buffer of {dst.nbytes} bytes for a {slot.length}-byte slot")
        n = slot.length
        await self._read_slot(slot, lambda mem, offset: mem.to_host(offset, dst[:n]))
        self.stats.bytes_out += n

    async def _read_slot(self, slot: Slot, use: Callable[[DeviceMemory, int], T]) -> None:
        started = time.perf_counter()
        copy = self._submit(use, self._mem, slot.offset)
        # held on the loop thread right after the submit: no free can run in between
        self.hold(slot.offset)
        try:
            await self._wait(copy)
        finally:  # a cancelled read still holds the slot until its thread has let go
            _when_done(copy, lambda: self.unhold(slot.offset))
        self.stats.seconds_out += time.perf_counter() - started

    def info(self) -> dict[str, Any]:
        return {
            "device": self._mem.device,
            "backend": self._mem.backend,
            **self._table_info(),
            "copy_threads": self.config.copy_threads,
        }

    async def close(self) -> None:
        """Wait for copies in flight, then free the pool (tensors from it become invalid)."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self._clear_table()
        self._mem.close()

    # -- internals ----------------------------------------------------------------------

    def _submit(self, fn: Callable[[DeviceMemory, int], T], *args: Any) -> asyncio.Future[T]:
        return asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _wait(self, copy: asyncio.Future[T]) -> T:
        """The copy's result. Shielded: cancelling the caller does not pretend the thread has
        stopped (a running executor job cannot be cancelled); see :func:`_when_done`."""
        try:
            return await asyncio.shield(copy)
        except CudaCallError as exc:
            self.stats.errors += 1
            raise TierError(f"gpu: {exc}") from exc

    def _free_unless_closed(self, offset: int) -> None:
        if not self._closed:  # close() dropped the whole table (and the pool)
            self._free(offset)


def _when_done(copy: asyncio.Future[Any], then: Callable[[], None]) -> None:
    """Run ``then`` (free or release a slot) once ``copy``'s thread has ended: now when it
    has, else from the event loop when it does; never while the thread still uses the slot."""
    if copy.done():
        then()
    else:
        copy.add_done_callback(lambda _: then())


# Registered by call rather than as a decorator so that type checkers keep the class type.
register_tier("gpu")(GpuTier)
