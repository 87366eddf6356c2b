"""SGLang HiCache L3 storage backend over kvstrata.

Pinned to **SGLang 0.5.23** (``sglang/srt/mem_cache/hicache_storage.py``,
``storage/backend_factory.py``, ``managers/cache_controller.py``). Loaded by SGLang's storage
backend factory::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "kvstrata", "module_path": "kvstrata.clients.sglang",
      "class_name": "KvstrataHiCacheStorage", "url": "redis://127.0.0.1:7379", "interface_v1": 1}'

One HiCache page is one kvstrata chunk, stored under ``SHA-256(page key)`` in a namespace made
of the model, the rank layout (TP rank and size, or ``mla`` when the KV is replicated across TP
ranks; PP/CP/DCP ranks when used) and, once SGLang registers its host pool, the KV dtype, page
size, layer count and pool layout (a page stored under another geometry is never matched).
``batch_exists`` is one ``KV.MATCH`` (the length of the present prefix is exactly HiCache's
question); consecutive pages are stored with their parent link so kvstrata's prefix-aware
eviction keeps chains whole.

Quirks of SGLang 0.5.23 this module follows:

- The factory builds a ``dynamic`` backend as ``cls(storage_config, kwargs)``, positionally,
  with ``kwargs`` empty: the extra config (``url`` …) is ``storage_config.extra_config``. The
  host pool is registered afterwards (``register_mem_pool_host``), so the namespace gains its
  dtype/page-size/layout parts then.
- Page keys are hex SHA-256 page hashes of a chain, sometimes with a pool suffix
  (``<hash>.mamba``): longer than 64 bytes, hence hashed again here.
- The zero-copy ``batch_get_v1``/``batch_set_v1`` are only used when the extra config has
  ``"interface_v1": 1``; they address pages by raw pointers
  (``mem_pool_host.get_page_buffer_meta``: K and V buffers per page for ``page_first``, per
  layer for ``layer_first``). A page's buffers are stored back to back in one chunk. On the
  server's host they are copied through its shared-memory arena (``KV.LEASE``; writes: one
  ``KV.MRESERVE`` and one ``KV.COMMIT`` per batch); elsewhere through ``KV.MGET``/``KV.PUT``.
- The prefetch and backup threads call the backend at once; the client's pool makes every call
  thread-safe, counters sit behind a lock.
- Methods return HiCache's failure values (``None``, ``False``, ``0``) when the server cannot
  be reached, as SGLang's own backends do: a storage outage is a cache miss, never a failed
  request. Each such failure is logged and counted (``get_stats().errors``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvstrata.clients.adapters import gather, key_hash, namespace_of, pointer_array, scatter
from kvstrata.clients.handles import RegionMapError
from kvstrata.clients.leases import batch_slices
from kvstrata.clients.resp import BufferTooSmall
from kvstrata.clients.sync import Client
from kvstrata.protocol.errors import RespError

__all__ = ["HiCacheIOStats", "KvstrataHiCacheStorage"]

log = logging.getLogger(__name__)

#: What a call to an unreachable or refusing server raises.
_IO_ERRORS = (OSError, RespError, RegionMapError)


@dataclass
class HiCacheIOStats:
    """What ``get_stats`` returns: the fields of SGLang's ``StorageMetrics`` (pages and GB/s per
    prefetch and backup call since the last call) plus kvstrata's error count."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)
    errors: int = 0


def _identity(cfg: HiCacheStorageConfig) -> list[str]:
    model = (cfg.model_name or "model").replace("/", "-")
    parts = ["sglang", model, "mla" if cfg.is_mla_model else f"tp{cfg.tp_size}r{cfg.tp_rank}"]
    if cfg.pp_size > 1:
        parts.append(f"pp{cfg.pp_size}r{cfg.pp_rank}")
    if cfg.attn_cp_size > 1:
        parts.append(f"cp{cfg.attn_cp_size}r{cfg.attn_cp_rank}")
    if cfg.dcp_size > 1:
        parts.append(f"dcp{cfg.dcp_size}r{cfg.dcp_rank}")
    return parts


class KvstrataHiCacheStorage(HiCacheStorage):
    """HiCache storage in a kvstrata server; see the module docstring."""

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None
    ) -> None:
        extra = {**(kwargs or {}), **(storage_config.extra_config or {})}
        url = extra.get("url")
        if not url:
            raise ValueError('kvstrata HiCache storage: the extra config needs "url"')
        self.storage_config = storage_config
        self.url = str(url)
        self.ttl_ms: int | None = int(extra["ttl_ms"]) if extra.get("ttl_ms") else None
        self.zero_copy = bool(extra.get("zero_copy", True))
        try:
            self.client = Client.from_url(
                self.url,
                max_connections=int(extra.get("max_connections", 16)),
                client_name=f"sglang-hicache-tp{storage_config.tp_rank}",
            )
        except OSError as e:
            raise ConnectionError(f"kvstrata HiCache storage: cannot reach {self.url}: {e}") from e
        self._parts = _identity(storage_config)
        self.namespace = namespace_of(self._parts)
        self._lock = threading.Lock()
        self._stats = HiCacheIOStats()

    # -- identity ----------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        dtype = str(mem_pool_host.dtype).removeprefix("torch.")
        layout = getattr(mem_pool_host, "layout", None)
        layers = getattr(mem_pool_host, "layer_num", None)
        page = f"p{mem_pool_host.page_size}"
        # "kv": layer_first pages in the flat data page's order (K layers, then V layers); the
        # namespace without it held v1 pages in SGLang's K0 V0 K1 V1 order, never read as these
        order = "kv" if layout == "layer_first" else None
        parts = [*self._parts, dtype, page, layers and f"l{layers}", layout, order]
        self.namespace = namespace_of(parts)

    def _hashes(self, keys: Sequence[str]) -> list[bytes]:
        return [key_hash(k) for k in keys]

    def _failed(self, what: str, e: BaseException) -> None:
        with self._lock:
            self._stats.errors += 1
        log.warning("kvstrata HiCache storage %s failed (%s): %s", what, self.url, e)

    # -- existence -----------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading pages of ``keys`` are stored: one ``KV.MATCH``."""
        if not keys:
            return 0
        try:
            return self.client.match(self.namespace, self._hashes(keys))
        except _IO_ERRORS as e:
            self._failed("batch_exists", e)
            return 0

    # -- the generic (copying) path ------------------------------------------------------------

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Pages received straight into ``target_locations`` (CPU tensors) by one ``KV.MGET``;
        None for a miss or a stored page whose size differs from its target's."""
        if not keys:
            return []
        if target_locations is None:
            try:
                payloads = self.client.mget(self.namespace, self._hashes(keys))
            except _IO_ERRORS as e:
                self._failed("batch_get", e)
                return [None] * len(keys)
            return [None if p is None else _as_tensor(p) for p in payloads]
        targets = list(target_locations)
        try:
            bufs = [t.view(-1).view(torch.uint8) for t in targets]
            got = self.client.mget(self.namespace, self._hashes(keys), outs=bufs)
        except BufferTooSmall:  # a stored page larger than its target: find which
            return [self.get_one(k, t) for k, t in zip(keys, targets, strict=True)]
        except _IO_ERRORS as e:
            self._failed("batch_get", e)
            return [None] * len(keys)
        return [
            t if v is not None and len(v) == b.numel() else None
            for t, b, v in zip(targets, bufs, got, strict=True)
        ]

    def get_one(self, key: str, target: torch.Tensor) -> torch.Tensor | None:
        buf = target.view(-1).view(torch.uint8)
        try:
            got = self.client.get(self.namespace, key_hash(key), out=buf)
        except BufferTooSmall:
            return None
        except _IO_ERRORS as e:
            self._failed("get", e)
            return None
        return target if got is not None and len(got) == buf.numel() else None

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store pages (CPU tensors) in one pipelined write, each linked to the previous one;
        a page already stored counts as stored."""
        if not keys:
            return True
        if values is None or len(values) != len(keys):
            raise ValueError("batch_set needs one value per key")
        payloads = [_as_bytes(v) for v in values]
        return all(self._put_chain(self._hashes(keys), None, payloads))

    def _put_chain(
        self, hashes: list[bytes], parent: bytes | None, payloads: Sequence[Any]
    ) -> list[bool]:
        try:
            with self.client.pipeline() as p:
                for h, payload in zip(hashes, payloads, strict=True):
                    p.put(self.namespace, h, parent, payload, ttl_ms=self.ttl_ms, nx=True)
                    parent = h
                replies = p.execute(raise_on_error=False)
        except _IO_ERRORS as e:
            self._failed("batch_set", e)
            return [False] * len(hashes)
        ok = [not isinstance(r, RespError) for r in replies]
        if not all(ok):
            self._failed("batch_set", next(r for r in replies if isinstance(r, RespError)))
        return ok

    # -- the zero-copy path over the host pool (interface_v1) ----------------------------------

    def _page_buffers(self, keys: list[str], host_indices: torch.Tensor) -> list[list[np.ndarray]]:
        """Per page, the host pool's buffers of that page (views, no copy), in the byte order
        of SGLang's flat data page (``get_data_page``, what the generic path stores): all K,
        then all V. ``layer_first``'s buffer meta lists them K0 V0 K1 V1 …, so they are
        reordered; ``page_first`` gives one K and one V buffer, already in that order."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if not keys or len(ptrs) % len(keys):
            raise ValueError(f"{len(ptrs)} page buffers for {len(keys)} keys")
        n = len(ptrs) // len(keys)
        arrays = [pointer_array(int(p), int(s)) for p, s in zip(ptrs, sizes, strict=True)]
        pages = [arrays[i * n : (i + 1) * n] for i in range(len(keys))]
        if getattr(self.mem_pool_host, "layout", None) == "layer_first":
            pages = [page[0::2] + page[1::2] for page in pages]
        return pages

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Load pages into the host pool; True for each page loaded (a prefix)."""
        if not keys:
            return []
        start = time.perf_counter()
        pages = self._page_buffers(keys, host_indices)
        try:
            done = self._load(self._hashes(keys), pages)
        except _IO_ERRORS as e:
            self._failed("batch_get_v1", e)
            done = 0
        self._record("prefetch", done, pages, time.perf_counter() - start)
        return [i < done for i in range(len(keys))]

    def _load(self, hashes: list[bytes], pages: list[list[np.ndarray]]) -> int:
        if self.zero_copy:
            lease = self.client.lease(self.namespace, hashes, tier="dram")
            if lease is None:
                return 0
            with lease:
                try:
                    chunks = lease.arrays()
                except RegionMapError:
                    self.zero_copy = False  # the server is on another host: bytes over TCP
                else:
                    return scatter(chunks, pages)
        payloads = self.client.mget(self.namespace, hashes)
        present = []
        for p in payloads:
            if p is None:
                break
            present.append(np.frombuffer(p, np.uint8))
        return scatter(present, pages)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store pages from the host pool, the first linked to the last of
        ``extra_info.prefix_keys``; True for each page stored (or already there)."""
        if not keys:
            return []
        start = time.perf_counter()
        pages = self._page_buffers(keys, host_indices)
        prefix = extra_info.prefix_keys if extra_info is not None else None
        parent = key_hash(prefix[-1]) if prefix else None
        hashes = self._hashes(keys)
        if self.zero_copy:
            ok = self._store_in_place(hashes, parent, pages)
        else:
            ok = self._put_chain(hashes, parent, [np.concatenate(p) for p in pages])
        self._record("backup", sum(ok), pages, time.perf_counter() - start)
        return ok

    def _store_in_place(
        self, hashes: list[bytes], parent: bytes | None, pages: list[list[np.ndarray]]
    ) -> list[bool]:
        """One KV.MRESERVE for the pages (per batch of at most BATCH_CHUNKS / BATCH_BYTES),
        each page's buffers gathered into its slot, one KV.COMMIT. A page stored already is
        True, one another writer is storing right now False."""
        ok: list[bool] = []
        sizes = [sum(b.nbytes for b in bufs) for bufs in pages]
        for part in batch_slices(sizes):
            link = parent if part.start == 0 else hashes[part.start - 1]
            try:
                with self.client.reserve_chain(self.namespace, link, hashes[part], sizes[part],
                                               ttl_ms=self.ttl_ms) as batch:  # fmt: skip
                    for i in batch.reserved:
                        gather(pages[part.start + i], batch.array(i))
            except RegionMapError:
                self.zero_copy = False  # the server is on another host: bytes over TCP
                rest = [np.concatenate(p) for p in pages[part.start :]]
                return ok + self._put_chain(hashes[part.start :], link, rest)
            except _IO_ERRORS as e:
                self._failed("batch_set_v1", e)
                return ok + [False] * (len(hashes) - part.start)
            ok += [state != "busy" for state in batch.states]
        return ok

    # -- housekeeping --------------------------------------------------------------------------

    def _record(self, kind: str, pages: int, bufs: list[list[np.ndarray]], seconds: float) -> None:
        if not self.storage_config.enable_storage_metrics or not pages:
            return
        nbytes = sum(b.nbytes for page in bufs[:pages] for b in page)
        with self._lock:
            getattr(self._stats, f"{kind}_pgs").append(pages)
            getattr(self._stats, f"{kind}_bandwidth").append(nbytes / 1e9 / max(seconds, 1e-9))

    def get_stats(self) -> HiCacheIOStats:
        """Pages and GB/s of each zero-copy call since the last call (with
        ``enable_storage_metrics``), and errors; the counters restart."""
        with self._lock:
            stats, self._stats = self._stats, HiCacheIOStats()
        return stats

    def clear(self) -> bool:
        """Delete every page of this backend's namespace from the server."""
        pattern = f"kv:{self.namespace}:*"
        cursor: Any = 0
        try:
            while True:
                cursor, keys = self.client.execute("SCAN", cursor, "MATCH", pattern, "COUNT", 1000)
                if keys:
                    self.client.execute("DEL", *keys)
                if int(cursor) == 0:
                    return True
        except _IO_ERRORS as e:
            self._failed("clear", e)
            return False

    def close(self) -> None:
        self.client.close()


def _as_bytes(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().contiguous().view(-1).view(torch.uint8)
    return value


def _as_tensor(payload: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8)
