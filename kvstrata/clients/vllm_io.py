"""Byte movement of the vLLM tier: chunks between rows of vLLM's primary (CPU) tier and kvstrata.

Loads: a ``KV.LEASE`` of the chunks in the server's shared-memory arena (``TIER dram``: the
scheduler process copies with the CPU), then one memcpy per chunk from the leased view into
its primary row, and ``KV.RELEASE``. Chunks the lease did not cover (a gap in the chain), or
every chunk when the lease is refused (``-OOM``: no room to promote into the arena) or the arena
cannot be mapped here (server on another host), come with one ``KV.MGET`` received in place
into the primary rows. Stores: the job's chunks are cut into chains (each chunk's parent the
one before it, same tokens), each stored by ``Client.put_chain``: ``KV.MRESERVE``, one memcpy
per row into its slot, ``KV.COMMIT``, a chain longer than one part streamed (the server reserves
and publishes while the rows are copied, :mod:`kvstrata.clients.chain_stream`); ``KV.PUT`` of
each row (sent from the row itself, no copy) when the arena cannot be mapped.
Each load reports, per chunk, whether its row now holds the chunk's exact bytes; a failure
raises and leaves that per-chunk record behind.

Nothing here imports vLLM. The client is made on first use and kept; its pool reconnects by
itself after a server restart (a new connection also re-reads the server's regions).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvstrata.clients.handles import RegionMapError
from kvstrata.clients.sync import Client
from kvstrata.protocol.errors import CommandError, RespError

__all__ = ["ChunkMover", "LoadMode", "StoreItem", "chains_of", "rows_of"]

LoadMode = Literal["auto", "lease", "mget"]


@dataclass(frozen=True, slots=True)
class StoreItem:
    """One chunk to store: its hash, its parent's (b"" for none), its primary row, its tokens."""

    hash: bytes
    parent: bytes
    row: int
    tokens: int


def rows_of(view: memoryview) -> np.ndarray:
    """vLLM's primary view (2-D, ``view[c]`` raises NotImplementedError) as a 2-D uint8 array
    over the same memory: row ``c`` is chunk ``c``, ``strides[0]`` bytes long."""
    arr = np.asarray(view)
    if arr.ndim < 1 or not arr.flags.c_contiguous:
        raise ValueError("the primary KV view must be C-contiguous with one row per chunk")
    return arr.reshape(arr.shape[0], -1).view(np.uint8)


class ChunkMover:
    """Loads and stores rows of ``rows`` as chunks of ``namespace``; safe to share by threads."""

    def __init__(
        self,
        connect: Callable[[], Client],
        namespace: str,
        rows: np.ndarray,
        load: LoadMode = "auto",
        lease_ttl_ms: int = 30_000,
    ) -> None:
        if load not in ("auto", "lease", "mget"):
            raise ValueError(f"load must be auto, lease or mget, not {load!r}")
        self._connect = connect
        self.namespace = namespace
        self.rows = rows
        self.load_mode: LoadMode = load
        self.shared_memory = load != "mget"  # False once the arena proved unreachable
        self.lease_ttl_ms = lease_ttl_ms
        self._client: Client | None = None
        self._lock = threading.Lock()

    @property
    def row_bytes(self) -> int:
        return int(self.rows.shape[1])

    def client(self) -> Client:
        """The client, connecting on first use (raises OSError while the server is down)."""
        with self._lock:
            if self._client is None:
                self._client = self._connect()
            return self._client

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def _arena_unreachable(self, exc: RegionMapError) -> None:
        if self.load_mode == "lease":
            raise exc
        self.shared_memory = False  # another host: stop trying, use the socket

    # -- loads ------------------------------------------------------------------------------

    def load(self, hashes: Sequence[bytes], row_ids: Sequence[int], loaded: list[bool]) -> None:
        """Fill ``row_ids[i]`` with chunk ``hashes[i]``; ``loaded[i]`` says which were (it is
        filled in as chunks land, so it is right even when this raises half-way)."""
        client = self.client()
        if self.shared_memory:
            try:
                self._load_leased(client, hashes, row_ids, loaded)
            except RespError:  # e.g. -OOM promoting into a pinned-full arena: read through
                pass
        rest = [i for i in range(len(hashes)) if not loaded[i]]
        if rest:
            self._load_received(client, hashes, row_ids, rest, loaded)

    def _load_leased(
        self, client: Client, hashes: Sequence[bytes], row_ids: Sequence[int], loaded: list[bool]
    ) -> None:
        lease = client.lease(self.namespace, hashes, ttl_ms=self.lease_ttl_ms, tier="dram")
        if lease is None:
            return
        try:
            views = lease.views()
            for i, view in enumerate(views):
                dst = self.rows[row_ids[i]]
                if len(view) == dst.nbytes:
                    dst[:] = np.frombuffer(view, dtype=np.uint8)  # the one copy
                    loaded[i] = True
        except RegionMapError as exc:
            self._arena_unreachable(exc)
        finally:
            try:
                lease.release()
            except (OSError, CommandError):
                pass  # bytes already copied under the lease; its TTL ends it server side

    def _load_received(
        self,
        client: Client,
        hashes: Sequence[bytes],
        row_ids: Sequence[int],
        todo: list[int],
        loaded: list[bool],
    ) -> None:
        outs = [memoryview(self.rows[row_ids[i]]) for i in todo]
        payloads = client.mget(self.namespace, [hashes[i] for i in todo], outs=outs)
        for i, payload in zip(todo, payloads, strict=True):
            loaded[i] = payload is not None and len(payload) == self.row_bytes

    # -- stores -----------------------------------------------------------------------------

    def store(self, items: Sequence[StoreItem]) -> int:
        """Store every item not already there; returns how many were written. Raises on the
        first failure (server down, ``-OOM`` …); chunks committed before it stay."""
        client = self.client()
        return sum(self._store_chain(client, chain) for chain in chains_of(items))

    def _store_chain(self, client: Client, chain: Sequence[StoreItem]) -> int:
        if self.shared_memory:
            hashes = [item.hash for item in chain]
            rows = [self.rows[item.row] for item in chain]  # the one copy, checksummed on the way
            states = client.put_chain(
                self.namespace, hashes, rows, chain[0].parent, tokens=chain[0].tokens
            )
            if not client.shared_memory:  # it went over the socket: the arena is not here
                self._arena_unreachable(RegionMapError("the server's arena is not on this host"))
            return states.count("stored")  # stored before, or being written elsewhere: not
        written = 0
        for item in chain:
            src = self.rows[item.row]
            written += bool(client.put(self.namespace, item.hash, item.parent, src,
                                       tokens=item.tokens, nx=True))  # fmt: skip
        return written


def chains_of(items: Sequence[StoreItem]) -> list[list[StoreItem]]:
    """Consecutive items cut where an item's parent is not the item before it, or its token
    count differs (KV.MRESERVE links each chunk to the previous one, with one TOKENS)."""
    chains: list[list[StoreItem]] = []
    for item in items:
        last = chains[-1][-1] if chains else None
        if last is not None and item.parent == last.hash and item.tokens == last.tokens:
            chains[-1].append(item)
        else:
            chains.append([item])
    return chains
