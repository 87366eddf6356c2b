"""An LMCache remote storage plugin that stores LMCache's chunks in kvstrata.

Pinned to **LMCache 0.5.6** (``lmcache/v1/storage_backend/connector/__init__.py``,
``base_connector.py``, ``remote_backend.py``). Enabled with LMCache's plugin configuration::

    remote_storage_plugins: ["kvstrata"]
    extra_config:
      remote_storage_plugin.kvstrata.module_path: kvstrata.clients.lmcache
      remote_storage_plugin.kvstrata.class_name: KvstrataConnector
      remote_storage_plugin.kvstrata.url: redis://127.0.0.1:7379

Each LMCache chunk is one kvstrata chunk: LMCache's own ``RemoteMetadata`` header (length,
shapes, dtypes, memory format) followed by the KV bytes, so a read needs no second key. The
chunk hash is ``SHA-256(key.to_string())`` in a namespace of the key's model, world size, worker
and dtype. Existence of a batch is one ``KV.MATCH`` (LMCache asks for the leading hits, which is
what it answers); batched reads are one ``KV.LEASE`` (copied out of the server's shared-memory
arena when it is on this host) or one ``KV.MGET``; batched writes are one ``KV.MRESERVE`` and
one ``KV.COMMIT`` on this host (copies into the reserved slots), else pipelined ``KV.PUT``s,
and link each chunk to the one before it; the parent of a batch's first chunk is remembered
from earlier lookups, so kvstrata's eviction keeps prefixes whole.

Quirks of LMCache 0.5.6 this module follows:

- A plugin is built as ``KvstrataConnector(loop=, local_cpu_backend=, config=)``: no URL and no
  plugin name reach it, so the URL is read from ``remote_storage_plugin.<name>.url`` of the
  plugin entry whose ``module_path`` is this module; metadata comes from
  ``local_cpu_backend.metadata``.
- Coroutines (``get``, ``put``, ``exists``, batched forms) run on LMCache's event-loop thread;
  ``exists_sync`` and ``batched_contains`` are called from the engine's threads. All of them use
  one thread-safe blocking client; coroutines hand its calls to a small thread pool so the loop
  never blocks on the network.
- ``put``'s memory object is released by LMCache's wrapper, not here; ``get`` returns a new one
  from ``local_cpu_backend.allocate`` with the stored shapes, dtypes and format (partial chunks
  come back with their own token count).
- ``key.to_string()`` can exceed the 64 bytes of a chunk hash (tags), hence the digest; the
  digest cannot be turned back into a key, so ``list()`` returns nothing.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from typing import Any, TypeVar

import numpy as np
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvstrata.clients.adapters import key_hash, namespace_of
from kvstrata.clients.handles import RegionMapError
from kvstrata.clients.leases import batch_slices
from kvstrata.clients.sync import Client

__all__ = ["KvstrataConnector", "plugin_url"]

T = TypeVar("T")
_PREFIX = "remote_storage_plugin."
PARENTS_REMEMBERED = 1 << 16


def plugin_url(config: Any) -> tuple[str, str]:
    """(plugin name, URL) of the plugin entry of ``config`` that loads this module."""
    extra = config.extra_config or {}
    for name in config.remote_storage_plugins or ():
        if extra.get(f"{_PREFIX}{name}.module_path") == __name__:
            url = extra.get(f"{_PREFIX}{name}.url")
            if not url:
                raise ValueError(f"kvstrata LMCache plugin: set extra_config {_PREFIX}{name}.url")
            return str(name), str(url)
    raise ValueError(f"kvstrata LMCache plugin: no remote_storage_plugins entry uses {__name__}")


class _Parents:
    """Bounded memory of which chunk precedes which (learned from lookups and batched writes)."""

    def __init__(self, capacity: int = PARENTS_REMEMBERED) -> None:
        self._map: OrderedDict[bytes, bytes] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def learn(self, chain: Sequence[bytes]) -> None:
        with self._lock:
            for parent, child in pairwise(chain):
                self._map[child] = parent
                self._map.move_to_end(child)
            while len(self._map) > self._capacity:
                self._map.popitem(last=False)

    def get(self, child: bytes) -> bytes | None:
        with self._lock:
            return self._map.get(child)


class KvstrataConnector(RemoteConnector):
    """LMCache ``RemoteConnector`` over kvstrata; see the module docstring."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any):
        super().__init__(config, local_cpu_backend.metadata)
        name, self.url = plugin_url(config)
        extra = config.extra_config or {}

        def opt(key: str, default: Any) -> Any:
            return extra.get(f"{_PREFIX}{name}.{key}", default)

        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.ttl_ms: int | None = int(opt("ttl_ms", 0)) or None
        self.zero_copy = bool(opt("zero_copy", True))
        threads = int(opt("threads", 8))
        self.client = Client.from_url(
            self.url, max_connections=threads + 4, client_name="lmcache-kvstrata"
        )
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvstrata-lmcache")
        self._parents = _Parents()

    # -- identity ------------------------------------------------------------------------------

    @staticmethod
    def namespace(key: Any) -> str:
        dtype = str(key.dtype).removeprefix("torch.")
        return namespace_of(
            ["lmcache", key.model_name, f"w{key.world_size}r{key.worker_id}", dtype]
        )

    def _chain(self, keys: Sequence[Any]) -> tuple[str, list[bytes]]:
        """The namespace of ``keys[0]`` and the hashes of the leading keys that share it."""
        ns = self.namespace(keys[0])
        hashes = []
        for k in keys:
            if self.namespace(k) != ns:
                break
            hashes.append(key_hash(k.to_string()))
        return ns, hashes

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # -- existence -----------------------------------------------------------------------------

    def _match(self, keys: Sequence[Any]) -> int:
        if not keys:
            return 0
        ns, hashes = self._chain(keys)
        self._parents.learn(hashes)
        return self.client.match(ns, hashes)

    async def exists(self, key: Any) -> bool:
        return await self._off_loop(self._match, [key]) == 1

    def exists_sync(self, key: Any) -> bool:
        return self._match([key]) == 1

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[Any]) -> int:
        """Leading keys stored: one ``KV.MATCH`` (called from the engine's threads)."""
        return self._match(keys)

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(
        self, lookup_id: str, keys: list[Any], pin: bool = False
    ) -> int:
        return await self._off_loop(self._match, keys)

    # -- reads ---------------------------------------------------------------------------------

    async def get(self, key: Any) -> Any:
        return (await self._off_loop(self._get_many, [key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[Any]) -> list[Any]:
        return await self._off_loop(self._get_many, keys)

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[Any]) -> list[Any]:
        """The leading chunks found (LMCache's contract: a prefix)."""
        objs = await self._off_loop(self._get_many, keys)
        out = []
        for i, obj in enumerate(objs):
            if obj is None:
                for rest in objs[i + 1 :]:
                    if rest is not None:
                        rest.ref_count_down()
                break
            out.append(obj)
        return out

    def _get_many(self, keys: Sequence[Any]) -> list[Any]:
        out: list[Any] = []
        while len(out) < len(keys):
            ns, hashes = self._chain(keys[len(out) :])
            out += self._read(ns, hashes)
        return out

    def _read(self, ns: str, hashes: list[bytes]) -> list[Any]:
        """Memory objects of the chunks (None for a miss): leased prefix, then one MGET."""
        out: list[Any] = []
        if self.zero_copy:
            lease = self.client.lease(ns, hashes, tier="dram")
            if lease is not None:
                with lease:
                    try:
                        chunks = lease.arrays()
                    except RegionMapError:
                        self.zero_copy = False  # the server is on another host
                    else:
                        out = [self._restore(a) for a in chunks]
        if len(out) < len(hashes):
            payloads = self.client.mget(ns, hashes[len(out) :])
            out += [
                None if p is None else self._restore(np.frombuffer(p, np.uint8)) for p in payloads
            ]
        return out

    def _restore(self, chunk: np.ndarray) -> Any:
        """A memory object from a stored chunk (header + bytes); None if it does not parse."""
        head = self.remote_metadata_bytes
        if chunk.nbytes < head:
            return None
        meta = RemoteMetadata.deserialize(chunk[:head].tobytes())
        if meta.length != chunk.nbytes - head:
            return None
        obj = self.local_cpu_backend.allocate(meta.shapes, meta.dtypes, meta.fmt)
        if obj is None:
            return None
        dst = np.frombuffer(obj.byte_array, np.uint8)
        if dst.nbytes < meta.length:
            obj.ref_count_down()
            return None
        dst[: meta.length] = chunk[head:]
        return obj

    # -- writes --------------------------------------------------------------------------------

    async def put(self, key: Any, memory_obj: Any) -> None:
        await self._off_loop(self._write, [key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[Any], memory_objs: list[Any]) -> None:
        await self._off_loop(self._write, keys, memory_objs)

    def _write(self, keys: Sequence[Any], objs: Sequence[Any]) -> None:
        done = 0
        while done < len(keys):
            ns, hashes = self._chain(keys[done:])
            self._parents.learn(hashes)
            parent = self._parents.get(hashes[0])
            chunk_objs = objs[done : done + len(hashes)]
            if self.zero_copy:
                self._write_in_place(ns, hashes, parent, chunk_objs)
            else:
                self._write_tcp(ns, hashes, parent, chunk_objs)
            done += len(hashes)

    def _header(self, obj: Any, body: np.ndarray) -> bytes:
        meta = RemoteMetadata(
            body.nbytes, obj.get_shapes(), obj.get_dtypes(), obj.get_memory_format()
        )
        return meta.serialize()

    def _write_in_place(
        self, ns: str, hashes: list[bytes], parent: bytes | None, objs: Sequence[Any]
    ) -> None:
        """One KV.MRESERVE per batch of the chain (header + KV bytes per chunk), the copies
        into the slots, one KV.COMMIT; chunks stored already (or being stored) are skipped."""
        bodies = [np.frombuffer(obj.byte_array, np.uint8) for obj in objs]
        heads = [self._header(obj, body) for obj, body in zip(objs, bodies, strict=True)]
        sizes = [len(h) + b.nbytes for h, b in zip(heads, bodies, strict=True)]
        for part in batch_slices(sizes):
            link = parent if part.start == 0 else hashes[part.start - 1]
            try:
                with self.client.reserve_chain(ns, link, hashes[part], sizes[part],
                                               ttl_ms=self.ttl_ms) as batch:  # fmt: skip
                    for i in batch.reserved:
                        head, view = heads[part.start + i], batch.array(i)
                        view[: len(head)] = np.frombuffer(head, np.uint8)
                        view[len(head) :] = bodies[part.start + i]
            except RegionMapError:
                self.zero_copy = False  # the server is on another host
                self._write_tcp(ns, hashes[part.start :], link, objs[part.start :])
                return

    def _write_tcp(
        self, ns: str, hashes: list[bytes], parent: bytes | None, objs: Sequence[Any]
    ) -> None:
        with self.client.pipeline() as p:
            for h, obj in zip(hashes, objs, strict=True):
                body = np.frombuffer(obj.byte_array, np.uint8)
                payload = np.concatenate([np.frombuffer(self._header(obj, body), np.uint8), body])
                p.put(ns, h, parent, payload, ttl_ms=self.ttl_ms, nx=True)
                parent = h
            p.execute()

    # -- the rest of the interface -------------------------------------------------------------

    def remove_sync(self, key: Any) -> bool:
        return self.client.delete(self.namespace(key), key_hash(key.to_string())) > 0

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        return 0 if await self._off_loop(self.client.ping) else 1

    async def list(self) -> list[str]:
        """Always empty: chunks are stored under digests of LMCache's keys."""
        return []

    async def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.client.close()
