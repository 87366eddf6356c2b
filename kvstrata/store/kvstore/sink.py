"""Payloads received in place: the invisible DRAM slot a chunk's bytes land in, unpublished.

:class:`StoreSink` is the slot of a KV.RESERVE write lease, or of a KV.PUT payload still
arriving: :meth:`PayloadSlots.reserve_put` (a mixin of
:class:`~kvstrata.store.kvstore.write.WritePath`) reserves it under a provisional key as the
connection starts receiving a large payload, so the kernel writes the bytes where they will
live and the checksum is folded in as they arrive; the write path binds it to the chunk's key
when the command runs.
"""

from __future__ import annotations

import itertools
from typing import Any

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.store.kvstore.state import StoreState
from kvstrata.store.placement import Placement
from kvstrata.tiers.base import TierError
from kvstrata.tiers.checksum import RunningChecksum, checksum

#: share of the DRAM arena that payloads still arriving may reserve: a stalled upload (even of
#: almost the arena's size) never leaves other writers without room; beyond it a payload is
#: buffered as it arrives and copied in when its command runs
RECEIVING_SHARE = 0.5
_SINK_NS = "\0payload"  # never a client namespace (validated): provisional slot keys
_sink_ids = itertools.count(1)


class StoreSink:
    """A reserved, invisible DRAM slot (implements ``PayloadSink``).

    A write lease's sink (KV.RESERVE) owns the key's claim from the start. A KV.PUT payload's
    sink does not: its slot is reserved under a provisional key while the bytes arrive, and the
    key is claimed only when the command runs (so a stalled upload or a command queued behind
    it never blocks other writers of the key); ``place`` then binds the slot to the chunk.
    ``abort()`` frees the slot (and the claim it owns); it is a no-op once the slot was
    committed, so callers may always call it in a ``finally``.
    """

    def __init__(
        self,
        state: StoreState,
        key: ChunkKey,
        view: memoryview,
        slot_key: ChunkKey | None = None,
        on_settled: Any = None,
    ) -> None:
        self.state = state
        self._on_settled = on_settled  # called once when the provisional slot is bound or freed
        self.key = key
        self.view = view
        self.nbytes = view.nbytes
        self.slot_key = key if slot_key is None else slot_key
        self.owns_claim = slot_key is None
        self.consumed = False
        self.done = False
        self._sum: RunningChecksum | None = None  # fed by the connection as bytes arrive

    def received(self, filled: int) -> None:
        """The connection received bytes ``[0, filled)`` of the payload into the slot: fold
        them into the checksum now, while they are in the CPU cache."""
        if self._sum is None:
            self._sum = RunningChecksum()
        self._sum.advance(self.view, filled)

    def checksum(self) -> bytes:
        """The checksum of the slot's bytes (the rest of what ``received`` folded in)."""
        return checksum(self.view) if self._sum is None else self._sum.digest(self.view)

    def consume(self) -> StoreSink:
        self.consumed = True
        return self

    async def host_bytes(self) -> memoryview:
        return self.view

    def place(self, meta: ChunkMeta) -> list[str]:
        """Commit the slot (the chunk's DRAM copy); the tiers it is now in."""
        dram = self.state.dram
        assert dram is not None
        if self.slot_key != meta.key:
            dram.rekey_reserved(self.slot_key, meta.key)
            self.slot_key = meta.key
        self._settle()
        dram.commit(meta)
        return [dram.name]

    def abort(self) -> None:
        if self.done:
            return
        self.done = True
        if self.owns_claim:  # a write lease's slot given back unpublished (KV.ABORT, expiry)
            self.state.trace("abort", self.key.namespace, [self.key.hash])
        self._settle()
        if self.state.dram is not None:
            self.state.dram.abort(self.slot_key)
        if self.owns_claim:
            self.state.release_claim(self.key)

    def _settle(self) -> None:
        if self._on_settled is not None:
            on_settled, self._on_settled = self._on_settled, None
            on_settled(self.nbytes)

    def committed(self) -> None:
        self.done = True
        if self.owns_claim:
            self.state.release_claim(self.key)


class PayloadSlots:
    """Mixin of ``WritePath``: DRAM slots for KV.PUT payloads still arriving."""

    # state owned by WritePath
    state: StoreState
    placement: Placement
    receiving: int

    # -- synchronous reservation for large payloads ----------------------------------------------

    def reserve_put(self, ns: str, hash: bytes, parent: bytes, nbytes: int) -> StoreSink | None:
        """A DRAM slot for an arriving KV.PUT payload, or None (the caller buffers it itself)
        when there is no room now, or when payloads still arriving would hold more than
        RECEIVING_SHARE of the arena. The key is not claimed here (see StoreSink)."""
        dram = self.state.dram
        if dram is None or nbytes <= 0 or self.receiving + nbytes > dram.capacity * RECEIVING_SHARE:
            return None
        if len(self.placement.room):  # writers wait for room: this one queues behind them
            self.placement.kick_now()
            return None
        slot_key = ChunkKey(_SINK_NS, next(_sink_ids).to_bytes(8, "big"))
        try:
            view = dram.reserve(slot_key, nbytes)
        except TierError:
            self.placement.kick()
            return None
        self.receiving += nbytes
        return StoreSink(self.state, ChunkKey(ns, hash), view, slot_key, self._settled)

    def _settled(self, nbytes: int) -> None:
        self.receiving -= nbytes
