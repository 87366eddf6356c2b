"""Lease objects: zero-copy read leases (``KV.LEASE``) and write leases (``KV.RESERVE``).

The view methods live here, shared by the sync and async clients; ``sync.py`` and ``aio.py``
add how a lease ends (``release``/``commit``/``abort``, blocking or awaited) and the context
manager protocol. A view is valid only while its lease is held.

A lease with handles in a ``cuda`` region has a :meth:`~LeaseBase.fence`: the wait for the
GPU work this thread has queued so far (torch's and CuPy's current streams). The clients wait
on it before ``release``, ``commit`` and ``abort``: ``engine_tensor.copy_(lease_tensor)`` is
only queued when it returns, and the server may reuse a released slot or checksum a committed
one at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from kvstrata.clients.cuda_ipc import stream_fence
from kvstrata.clients.handles import HandleViews, mapped_devices
from kvstrata.clients.resp import as_bytes_view
from kvstrata.clients.results import Handle, LeaseGrant, LeaseId, RegionInfo, ReserveGrant

__all__ = ["Fence", "LeaseBase", "WriteLeaseBase", "run_fence"]

log = logging.getLogger(__name__)

#: Waits for the GPU work queued on a lease's ``cuda`` slots (see the module docstring).
Fence = Callable[[], None]


def run_fence(fence: Fence, strict: bool) -> None:
    """Wait on a lease's fence. When the wait fails (a CUDA error: the device runs nothing
    more of ours), ``release``/``abort`` log it and still reach the server (``strict`` False);
    ``commit`` raises (its bytes are not known to be complete) and aborts instead."""
    try:
        fence()
    except Exception as exc:
        if strict:
            raise
        log.warning("waiting for the GPU work on a lease failed (%s); ending the lease anyway", exc)


def _device_fence(regions: dict[str, RegionInfo], handles: Iterable[Handle]) -> Fence | None:
    used = {h.region: regions[h.region] for h in handles if h.region in regions}
    return stream_fence(mapped_devices(used.values()))


class LeaseBase(HandleViews):
    """A read lease: the server keeps the leased chunks pinned until it is released (or its TTL
    runs out). ``handles[i]`` is the chunk ``hashes[i]``; fewer handles than hashes means only a
    prefix was leased."""

    __slots__ = ("done", "grant", "hashes", "namespace")

    def __init__(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        grant: LeaseGrant,
        regions: dict[str, RegionInfo],
    ) -> None:
        super().__init__(regions, writable=False)
        self.namespace = namespace
        self.hashes = tuple(hashes[: len(grant.handles)])
        self.grant = grant
        self.done = False

    @property
    def lease_id(self) -> LeaseId:
        return self.grant.lease_id

    @property
    def handles(self) -> tuple[Handle, ...]:
        return self.grant.handles

    def __len__(self) -> int:
        return len(self.grant.handles)

    def fence(self) -> Fence | None:
        """The wait for this thread's queued GPU work on the leased ``cuda`` chunks (copies
        out of them); None when no handle is in a ``cuda`` region mapped here."""
        return _device_fence(self._regions, self.grant.handles)

    def views(self) -> list[memoryview]:
        """Read-only memoryviews of the chunks (``shm`` regions)."""
        return [self._view(h) for h in self.grant.handles]

    def payloads(self) -> list[Any]:
        """Each chunk as its region allows without a copy: a read-only memoryview (``shm``)
        or a 1-D uint8 CUDA tensor (``cuda``; do not write). One lease may mix both: a
        server with a GPU tier leases from DRAM the chunks its pool has no room for."""
        return [
            self._tensor(h, None) if self._region(h).kind == "cuda" else self._view(h)
            for h in self.grant.handles
        ]

    def arrays(self, dtype: Any = np.uint8) -> list[np.ndarray]:
        """Read-only 1-D numpy arrays of the chunks (``shm`` regions)."""
        return [self._array(h, dtype) for h in self.grant.handles]

    def tensors(self, dtype: Any = None) -> list[Any]:
        """1-D torch tensors of the chunks (CPU for ``shm``, CUDA for ``cuda``); do not write."""
        return [self._tensor(h, dtype) for h in self.grant.handles]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.lease_id!r} {len(self)} chunks>"


class WriteLeaseBase(HandleViews):
    """A reserved, invisible slot: fill it, then commit (publish) or abort (discard)."""

    __slots__ = ("done", "grant", "hash", "namespace")

    def __init__(
        self, namespace: str, hash: bytes, grant: ReserveGrant, regions: dict[str, RegionInfo]
    ) -> None:
        super().__init__(regions, writable=True)
        self.namespace = namespace
        self.hash = hash
        self.grant = grant
        self.done = False

    @property
    def lease_id(self) -> LeaseId:
        return self.grant.lease_id

    @property
    def handle(self) -> Handle:
        return self.grant.handle

    @property
    def nbytes(self) -> int:
        return self.grant.handle.length

    def fence(self) -> Fence | None:
        """The wait for this thread's queued GPU work on the slot (writes into it); None when
        the slot is not in a ``cuda`` region mapped here."""
        return _device_fence(self._regions, (self.grant.handle,))

    def view(self) -> memoryview:
        """The slot as a writable memoryview (``shm`` regions)."""
        return self._view(self.grant.handle)

    def array(self, dtype: Any = np.uint8) -> np.ndarray:
        """The slot as a writable 1-D numpy array (``shm`` regions)."""
        return self._array(self.grant.handle, dtype)

    def tensor(self, dtype: Any = None) -> Any:
        """The slot as a writable 1-D torch tensor (CPU for ``shm``, CUDA for ``cuda``)."""
        return self._tensor(self.grant.handle, dtype)

    def write(self, data: Any, offset: int = 0) -> None:
        """Copy ``data`` (bytes-like, numpy array, CPU tensor) into the slot at ``offset``."""
        src = as_bytes_view(data)
        n = len(src)
        if offset < 0 or offset + n > self.nbytes:
            raise ValueError(f"{n} bytes at offset {offset} do not fit a {self.nbytes}-byte slot")
        self.view()[offset : offset + n] = src

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.lease_id!r} {self.nbytes} bytes>"
