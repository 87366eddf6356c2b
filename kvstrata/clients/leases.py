"""Lease objects: zero-copy read leases (``KV.LEASE``) and write leases (``KV.RESERVE``).

A write batch (``KV.MRESERVE``) is one write lease over the slots of several chunks of a chain:
filled in place, then committed (or aborted) in one round trip.

``write`` of a whole ``shm`` slot copies and checksums the bytes in one pass
(``clients.copysum``) and the commit sends that digest (``KV.COMMIT … DIGEST``), so the server
does not hash the slot again; it checks the digest when the chunk first leaves DRAM, and a
wrong one only ever drops the chunk. A slot filled any other way (a view, an array, a tensor, a
partial write) is sent without a digest and hashed by the server, as before; taking a view of a
slot after ``write`` forgets its digest (the view may change the bytes).

The view methods live here, shared by the sync and async clients; ``sync_leases.py`` and
``aio_leases.py`` add how a lease ends (``release``/``commit``/``abort``, blocking or awaited)
and the context manager protocol. A view is valid only while its lease is held.

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

from kvstrata.clients.copysum import copy_checksum
from kvstrata.clients.cuda_ipc import stream_fence
from kvstrata.clients.handles import HandleViews, mapped_devices
from kvstrata.clients.resp import as_bytes_view
from kvstrata.clients.results import (
    BatchGrant,
    Handle,
    LeaseGrant,
    LeaseId,
    RegionInfo,
    ReserveGrant,
)

__all__ = [
    "BATCH_BYTES",
    "BATCH_CHUNKS",
    "Fence",
    "LeaseBase",
    "PublishGroups",
    "WriteBatchBase",
    "WriteLeaseBase",
    "batch_slices",
    "put_states",
    "run_fence",
]

log = logging.getLogger(__name__)

#: ``put_chain`` sends at most this many chunks / bytes per ``KV.MRESERVE``: a batch is reserved
#: whole or not at all, so a very long chain is cut where the arena could more easily refuse it.
BATCH_CHUNKS = 256
BATCH_BYTES = 256 * 1024 * 1024

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

    __slots__ = ("digest", "done", "grant", "hash", "namespace")

    def __init__(
        self, namespace: str, hash: bytes, grant: ReserveGrant, regions: dict[str, RegionInfo]
    ) -> None:
        super().__init__(regions, writable=True)
        self.namespace = namespace
        self.hash = hash
        self.grant = grant
        self.done = False
        #: the xxh3-128 of the slot as ``write`` filled it whole (sent with the commit)
        self.digest: bytes | None = None

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
        self.digest = None
        return self._view(self.grant.handle)

    def array(self, dtype: Any = np.uint8) -> np.ndarray:
        """The slot as a writable 1-D numpy array (``shm`` regions)."""
        self.digest = None
        return self._array(self.grant.handle, dtype)

    def tensor(self, dtype: Any = None) -> Any:
        """The slot as a writable 1-D torch tensor (CPU for ``shm``, CUDA for ``cuda``)."""
        self.digest = None
        return self._tensor(self.grant.handle, dtype)

    def write(self, data: Any, offset: int = 0) -> None:
        """Copy ``data`` (bytes-like, numpy array, CPU tensor) into the slot at ``offset``;
        filling a whole ``shm`` slot also checksums it on the way (see the module docstring)."""
        src = as_bytes_view(data)
        n = len(src)
        if offset < 0 or offset + n > self.nbytes:
            raise ValueError(f"{n} bytes at offset {offset} do not fit a {self.nbytes}-byte slot")
        self.digest = _write_slot(self._view(self.grant.handle), src, offset)

    def commit_digests(self) -> tuple[bytes, ...]:
        """What the commit sends after DIGEST: this slot's digest, or nothing."""
        return () if self.digest is None else (self.digest,)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.lease_id!r} {self.nbytes} bytes>"


class WriteBatchBase(HandleViews):
    """Reserved, invisible slots for chunks of one chain (``KV.MRESERVE``): fill them, then
    commit (publish them all, in chain order) or abort (discard them all). ``publish(i)``
    publishes filled chunks at once (a round trip) while the others are still being filled;
    commit then publishes the rest. A published chunk's slot is the stored chunk's: the batch
    gives no view of it any more (one taken before must not be used). ``hashes[i]`` has a
    slot when ``states[i] == "reserved"``; ``"exists"`` and ``"busy"`` chunks have none (stored
    already, or another client is writing them): nothing to write for them."""

    __slots__ = ("digests", "done", "grant", "hashes", "namespace", "published")

    def __init__(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        grant: BatchGrant,
        regions: dict[str, RegionInfo],
    ) -> None:
        super().__init__(regions, writable=True)
        self.namespace = namespace
        self.hashes = tuple(hashes)
        self.grant = grant
        self.done = grant.lease_id is None  # nothing reserved: nothing to commit
        self.published: list[tuple[int, ...]] = []  # groups sent with publish(), in order
        #: chunk index → the xxh3-128 of its slot as ``write`` filled it whole
        self.digests: dict[int, bytes] = {}

    @property
    def lease_id(self) -> LeaseId | None:
        return self.grant.lease_id

    @property
    def states(self) -> tuple[str, ...]:
        return self.grant.states

    @property
    def reserved(self) -> list[int]:
        """Indexes of the chunks that have a slot (to fill)."""
        return [i for i, h in enumerate(self.grant.handles) if h is not None]

    def __len__(self) -> int:
        return len(self.grant.handles)

    def unpublished(self) -> list[int]:
        """Reserved chunks not sent with ``publish`` yet (the final commit publishes them)."""
        done = {i for group in self.published for i in group}
        return [i for i in self.reserved if i not in done]

    def _check_unpublished(self, indexes: Sequence[int]) -> None:
        if not indexes:
            raise ValueError("publish() needs at least one chunk index")
        done = {i for group in self.published for i in group}
        for i in indexes:
            self._slot(i)
            if i in done:
                raise ValueError(f"chunk {i} is published already")
            done.add(i)

    def _lease(self) -> LeaseId:
        assert self.grant.lease_id is not None
        return self.grant.lease_id

    def _slot(self, i: int) -> Handle:
        handle = self.grant.handles[i]
        if handle is None:
            raise KeyError(f"chunk {i} has no slot: it is {self.grant.states[i]}")
        return handle

    def fence(self) -> Fence | None:
        """The wait for this thread's queued GPU work on the slots (see WriteLeaseBase)."""
        return _device_fence(self._regions, [h for h in self.grant.handles if h is not None])

    def _fill_slot(self, i: int) -> Handle:
        """Chunk ``i``'s slot, to fill: not once it was published (it is the stored chunk's
        then, and may hold another chunk once that one is evicted)."""
        if any(i in group for group in self.published):
            raise ValueError(f"chunk {i} is published: its slot is the stored chunk's now")
        return self._slot(i)

    def view(self, i: int) -> memoryview:
        """Chunk ``i``'s slot as a writable memoryview (``shm`` regions)."""
        slot = self._fill_slot(i)
        self.digests.pop(i, None)
        return self._view(slot)

    def array(self, i: int, dtype: Any = np.uint8) -> np.ndarray:
        """Chunk ``i``'s slot as a writable 1-D numpy array (``shm`` regions)."""
        slot = self._fill_slot(i)
        self.digests.pop(i, None)
        return self._array(slot, dtype)

    def tensor(self, i: int, dtype: Any = None) -> Any:
        """Chunk ``i``'s slot as a writable 1-D torch tensor (CPU ``shm``, CUDA ``cuda``)."""
        slot = self._fill_slot(i)
        self.digests.pop(i, None)
        return self._tensor(slot, dtype)

    def write(self, i: int, data: Any, offset: int = 0) -> None:
        """Copy ``data`` (bytes-like, numpy array, CPU tensor) into chunk ``i``'s slot;
        filling a whole ``shm`` slot also checksums it on the way (see the module docstring)."""
        src = as_bytes_view(data)
        slot = self._fill_slot(i)
        n, size = len(src), slot.length
        if offset < 0 or offset + n > size:
            raise ValueError(f"{n} bytes at offset {offset} do not fit a {size}-byte slot")
        self.digests.pop(i, None)
        digest = _write_slot(self._view(slot), src, offset)
        if digest is not None:
            self.digests[i] = digest

    def commit_args(self, indexes: Sequence[int]) -> tuple[tuple[int, ...], tuple[bytes, ...]]:
        """The indexes and DIGEST arguments of a ``KV.COMMIT`` of ``indexes`` (all chunks not
        published yet when empty): no digest at all when none of them has one, else one per
        index (empty for a slot without), the indexes then named explicitly."""
        named = tuple(indexes) or tuple(self.unpublished())
        if not any(i in self.digests for i in named):
            return tuple(indexes), ()
        return named, tuple(self.digests.get(i, b"") for i in named)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.lease_id!r} {len(self.reserved)}/{len(self)} slots>"


def _write_slot(slot: memoryview, src: bytes | memoryview, offset: int) -> bytes | None:
    """Copy ``src`` into ``slot`` at ``offset``; the digest of the slot when that filled it
    whole (in one pass), else None."""
    if offset == 0 and len(src) == slot.nbytes:
        return copy_checksum(slot, src)
    slot[offset : offset + len(src)] = src
    return None


def batch_slices(
    sizes: Sequence[int],
    max_chunks: int = BATCH_CHUNKS,
    max_bytes: int = BATCH_BYTES,
    min_chunks: int | None = None,
    min_bytes: int = 0,
) -> list[slice]:
    """Cut a chain into consecutive batches of at most ``max_chunks`` chunks and ``max_bytes``
    bytes (a single larger chunk is a batch of its own); with ``min_chunks``, a batch also ends
    once it holds ``min_chunks`` chunks and ``min_bytes`` bytes (``put_chain``'s streamed parts,
    ``chain_stream.pipe_slices``)."""
    out: list[slice] = []
    start, nbytes = 0, 0
    for i, size in enumerate(sizes):
        n = i - start
        full = min_chunks is not None and n >= min_chunks and nbytes >= min_bytes
        if n and (full or n >= max_chunks or nbytes + size > max_bytes):
            out.append(slice(start, i))
            start, nbytes = i, 0
        nbytes += size
    if start < len(sizes):
        out.append(slice(start, len(sizes)))
    return out


#: a writer publishes the chunks it has filled once they hold this many bytes: large enough that
#: small chunks do not cost one round trip each, small enough that chunks become visible (and a
#: lease that expired is heard of) while the rest are still being filled
PUBLISH_BYTES = 4 * 1024 * 1024


class PublishGroups:
    """Hands filled chunks to ``publish`` in groups of about ``PUBLISH_BYTES``; the batch's
    commit publishes the last, partial group."""

    __slots__ = ("_bytes", "_indexes", "_publish")

    def __init__(self, publish: Callable[..., Any]) -> None:
        self._publish = publish
        self._indexes: list[int] = []
        self._bytes = 0

    def add(self, index: int, nbytes: int) -> Any:
        """Record chunk ``index`` as filled; returns what ``publish`` returned (an awaitable for
        the async batch) when a group was sent, else None."""
        self._indexes.append(index)
        self._bytes += nbytes
        if self._bytes < PUBLISH_BYTES:
            return None
        indexes, self._indexes, self._bytes = self._indexes, [], 0
        return self._publish(*indexes)


def put_states(states: Sequence[str]) -> list[str]:
    """A batch's per-chunk states as ``put_chain`` reports them: ``stored`` (by this call),
    ``exists`` or ``busy``."""
    return ["stored" if s == "reserved" else s for s in states]
