"""An LMCache 0.5.6 remote storage stack on CPU, as LMCache's cache engine builds it: engine
config, metadata, a ``LocalCPUBackend`` that allocates memory objects, an event loop on its own
thread, and a ``RemoteBackend`` that makes its connector through LMCache's connector manager
(``remote_url`` for the built-in connectors, ``remote_storage_plugins`` for plugins)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.remote_backend import RemoteBackend

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def plugin_extra(url: str, **options: Any) -> dict[str, Any]:
    extra = {
        "remote_storage_plugin.kvstrata.module_path": "kvstrata.clients.lmcache",
        "remote_storage_plugin.kvstrata.class_name": "KvstrataConnector",
        "remote_storage_plugin.kvstrata.url": url,
    }
    extra.update({f"remote_storage_plugin.kvstrata.{k}": v for k, v in options.items()})
    return extra


@dataclass
class Stack:
    backend: RemoteBackend
    cpu: LocalCPUBackend
    metadata: LMCacheMetadata
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread

    def key(self, chunk_hash: int, worker: int | None = None) -> CacheEngineKey:
        md = self.metadata
        wid = md.worker_id if worker is None else worker
        return CacheEngineKey(md.model_name, md.world_size, wid, chunk_hash, md.kv_dtype)

    def chunk(self, tokens: int | None = None, seed: int = 0) -> Any:
        """A memory object filled with data (a partial chunk with ``tokens``)."""
        obj = self.cpu.allocate(self.metadata.get_shapes(tokens), self.metadata.get_dtypes(), None)
        gen = torch.Generator().manual_seed(seed)
        obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=gen).to(obj.tensor.dtype))
        return obj

    def put(self, keys: list[CacheEngineKey], objs: list[Any], timeout: float = 30) -> None:
        """Write chunks as ``RemoteBackend.batched_submit_put_task`` does (the connector's
        ``batched_put`` on LMCache's loop; it frees the objects), and wait for the write."""
        conn = self.backend.connection
        assert conn is not None, "no connection"
        self.run(conn.batched_put(keys, objs), timeout)

    def run(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        conn = self.backend.connection
        # LMCache 0.5.6's RedisConnector.close() never returns: it waits, on the loop thread,
        # for its executor's workers, which need that thread to finish. Only ours is closed.
        if conn is not None and type(conn._connector).__name__ == "KvstrataConnector":  # type: ignore[attr-defined]
            self.backend.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def make_stack(
    *,
    remote_url: str | None = None,
    extra: dict[str, Any] | None = None,
    chunk_size: int = 16,
    layers: int = 2,
    heads: int = 4,
    head_dim: int = 8,
    dtype: torch.dtype = torch.float16,
    worker_id: int = 0,
    cpu_gib: float = 0.25,
) -> Stack:
    plugin = extra is not None and any(k.startswith("remote_storage_plugin.") for k in extra)
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=chunk_size,
        local_cpu=False,
        max_local_cpu_size=cpu_gib,
        remote_url=remote_url,
        remote_serde="naive",
        remote_storage_plugins=["kvstrata"] if plugin else None,
        extra_config=extra,
    )
    metadata = LMCacheMetadata(
        model_name=MODEL,
        world_size=2,
        local_world_size=2,
        worker_id=worker_id,
        local_worker_id=worker_id,
        kv_dtype=dtype,
        kv_shape=(layers, 2, chunk_size, heads, head_dim),
        chunk_size=chunk_size,
    )
    cpu = LocalCPUBackend(config, metadata)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="lmcache-loop", daemon=True)
    thread.start()
    backend = RemoteBackend(config, metadata, loop, cpu, plugin_name="kvstrata" if plugin else None)
    return Stack(backend, cpu, metadata, loop, thread)
