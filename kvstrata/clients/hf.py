"""Prefix caching for ``transformers`` (5.x cache API) on top of a kvstrata client.

:class:`HFPrefixCache` wraps a decoder-only model and a client. For a prompt it

1. hashes the prompt's full chunks (:func:`kvstrata.store.hashing.chunk_hashes`) and asks the
   server, in one round trip, how long the cached prefix is (``KV.MATCH``);
2. loads those chunks (a ``KV.LEASE`` read in place when the server is on this host: from its
   shared memory, or from its GPU pool through CUDA IPC when it has a GPU tier and this process
   has CUDA; else one ``KV.MGET`` into a kept staging buffer) and decodes them straight
   into per-layer key/value tensors preallocated for the whole prefix, which become the layers
   of a ``DynamicCache``;
3. runs the model only on the rest of the prompt;
4. hands the prompt's new full chunks to a background thread that encodes and stores them,
   so generation goes on meanwhile (:meth:`HFPrefixCache.wait_stored` joins): encoded straight
   into slots of the server's shared memory reserved for the whole chain in one round trip
   (``KV.MRESERVE``, then one ``KV.COMMIT``) when the server is on this host, else one
   ``KV.PUT`` per chunk.

A prompt cached in full still runs its last token through the model (the next-token logits need
it): the restored prefix is one token shorter than the cached one.

Only batch size 1 and plain full-attention layers (``DynamicLayer``) are supported; sliding
window and linear-attention layers are refused rather than restored wrongly.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from kvstrata.clients.codecs import get_codec
from kvstrata.clients.handles import RegionMapError
from kvstrata.clients.hf_model import KVGeometry, kv_geometry, model_namespace
from kvstrata.clients.layout import ChunkLayout, pack_chunk, pack_into, packed_size, unpack_into
from kvstrata.clients.leases import batch_slices
from kvstrata.store.hashing import chunk_hashes

__all__ = ["GenerateResult", "HFPrefixCache", "KVClient", "PrefillResult", "model_namespace"]


class KVClient(Protocol):
    """The part of :class:`kvstrata.clients.sync.Client` this module uses. It must be safe to
    call from two threads (the real client is: it borrows a pooled connection per call).
    Optional: ``match_tiers`` (returns ``.matched`` and ``.tiers``), ``lease`` (zero-copy
    reads; returns an object with ``payloads()`` (or only ``views()``) and ``release()``, or
    None) and ``reserve_chain`` (zero-copy writes, see :meth:`Client.reserve_chain`)."""

    def match(self, ns: str, hashes: Sequence[bytes]) -> int: ...

    def mget(
        self, ns: str, hashes: Sequence[bytes], outs: Sequence[Any] | None = None
    ) -> list[Any]: ...

    def put(
        self, ns: str, hash: bytes, parent: bytes | None, payload: Any, tokens: int = 0
    ) -> Any: ...


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """The cache after the prompt, the next-token logits, and what was reused."""

    cache: DynamicCache
    logits: torch.Tensor  # [vocab], float32, at the last prompt position
    prompt_tokens: int
    reused_tokens: int  # restored from the server
    computed_tokens: int  # run through the model
    matched_chunks: int
    tiers: tuple[str, ...]  # tier of each matched chunk, when the client reports them
    match_s: float
    load_s: float
    compute_s: float

    @property
    def ttft_s(self) -> float:
        """Time to first token: match + load + prefill of the rest (the argmax is negligible)."""
        return self.match_s + self.load_s + self.compute_s


@dataclass(frozen=True, slots=True)
class GenerateResult:
    tokens: list[int]  # generated ids (greedy)
    prefill: PrefillResult


@dataclass(slots=True)
class _Stats:
    stored_chunks: int = 0
    errors: list[BaseException] = field(default_factory=list)


def _cache_kwarg(model: Any) -> str:
    """transformers ≥ 5.? names the argument ``cache``; earlier 5.x ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _as_ids(input_ids: Any) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"input_ids must be one sequence, got shape {tuple(ids.shape)}")
    return ids


def _dynamic_layers(cache: DynamicCache) -> list[DynamicLayer]:
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise NotImplementedError(f"cannot restore a {type(layer).__name__} cache layer")
    return list(cache.layers)  # type: ignore[arg-type]


class HFPrefixCache:
    """Restore cached prompt prefixes into a ``transformers`` model and store new chunks."""

    def __init__(
        self,
        model: Any,
        client: KVClient,
        *,
        chunk_tokens: int = 256,
        codec: str = "raw",
        namespace: str | None = None,
        extra: Sequence[bytes | str] = (),
        store_client: KVClient | None = None,
        load: Literal["auto", "lease", "mget"] = "auto",
    ) -> None:
        """``load``: ``lease`` reads chunks in place from the server's shared memory (same
        host), ``mget`` receives them over the socket, ``auto`` tries a lease and falls back.
        ``store_client``: a separate client for the background stores (default: ``client``)."""
        self.model = model
        self.client = client
        self.chunk_tokens = chunk_tokens
        self.codec = get_codec(codec).name
        self.namespace = namespace or model_namespace(model, chunk_tokens=chunk_tokens, codec=codec)
        self.extra = tuple(extra)
        self.geometry: KVGeometry = kv_geometry(model)
        self._cache_kw = _cache_kwarg(model)
        self.load = load
        self._store_client = store_client or client
        #: False once the server's arena proved unreachable (stores then go as KV.PUT)
        self.store_in_place = callable(getattr(self._store_client, "reserve_chain", None))
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstrata-store")
        self._pending: list[Future[int]] = []
        self._stats = _Stats()
        self._staging_buf = bytearray()

    def _staging(self, nbytes: int) -> memoryview:
        """A receive buffer kept between calls: fresh pages fault in at ~1 GB/s, touched
        ones copy at memory speed."""
        if len(self._staging_buf) < nbytes:
            self._staging_buf = bytearray(nbytes)
        return memoryview(self._staging_buf)[:nbytes]

    # -- public API ---------------------------------------------------------------------------

    def hashes(self, input_ids: Any) -> list[bytes]:
        """Chained hashes of the full chunks of ``input_ids``."""
        ids = _as_ids(input_ids)[0].numpy()
        return chunk_hashes(ids, self.namespace, self.chunk_tokens, self.extra)

    def prefill(self, input_ids: Any, *, store: bool = True) -> PrefillResult:
        """Match, restore, and compute the rest of the prompt; store its new full chunks."""
        ids = _as_ids(input_ids)
        hashes = self.hashes(ids)
        t0 = time.perf_counter()
        matched, tiers = self._match(hashes)
        t1 = time.perf_counter()
        want = min(matched * self.chunk_tokens, ids.shape[1] - 1)
        reuse_chunks = -(-want // self.chunk_tokens)
        cache = self._load(hashes[:reuse_chunks], want)
        reuse = cache.get_seq_length()  # shorter than ``want`` if a chunk vanished meanwhile
        t2 = time.perf_counter()
        logits = self._forward(ids[:, reuse:], cache)
        t3 = time.perf_counter()
        # a chunk that vanished after the match is stored again, from the one that was missing
        first = matched if reuse >= want else reuse // self.chunk_tokens
        if store and len(hashes) > first:
            self._store_async(cache, hashes, first, len(hashes))
        return PrefillResult(
            cache=cache,
            logits=logits,
            prompt_tokens=ids.shape[1],
            reused_tokens=reuse,
            computed_tokens=ids.shape[1] - reuse,
            matched_chunks=matched,
            tiers=tuple(tiers[: -(-reuse // self.chunk_tokens)]),
            match_s=t1 - t0,
            load_s=t2 - t1,
            compute_s=t3 - t2,
        )

    def generate(
        self, input_ids: Any, max_new_tokens: int, *, store: bool = True
    ) -> GenerateResult:
        """Greedy generation from a restored prefix. Afterwards the full chunks covering prompt
        and reply (as far as the cache holds them) are stored too, for the next turn."""
        ids = _as_ids(input_ids)
        pre = self.prefill(ids, store=store)
        out: list[int] = []
        logits, cache = pre.logits, pre.cache
        for step in range(max_new_tokens):
            token = int(logits.argmax())
            out.append(token)
            if step + 1 < max_new_tokens:
                logits = self._forward(torch.tensor([[token]]), cache)
        if store:
            have = cache.get_seq_length()  # the last token was never fed
            hashes = self.hashes(torch.cat([ids, torch.tensor([out])], dim=1)[:, :have])
            first = max(pre.matched_chunks, ids.shape[1] // self.chunk_tokens)
            if len(hashes) > first:
                self._store_async(cache, hashes, first, len(hashes))
        return GenerateResult(out, pre)

    def store(self, input_ids: Any, cache: DynamicCache, *, skip: int = 0) -> None:
        """Store in the background the full chunks of ``input_ids`` that ``cache`` holds (a
        cache computed elsewhere, e.g. by ``model.generate``), skipping the first ``skip``."""
        ids = _as_ids(input_ids)[:, : cache.get_seq_length()]
        hashes = self.hashes(ids)
        if len(hashes) > skip:
            self._store_async(cache, hashes, skip, len(hashes))

    def wait_stored(self, timeout: float | None = None) -> int:
        """Wait for every background store; return chunks stored so far. Each failed store is
        recorded (:attr:`store_errors`) and the first one re-raised once all are done. On
        ``timeout`` a ``TimeoutError`` is raised and every store stays pending for the next
        call."""
        pending, self._pending = self._pending, []
        _, running = wait(pending, timeout)
        if running:
            self._pending[:0] = pending
            raise TimeoutError(f"{len(running)} background stores still running")
        failures = [exc for fut in pending if (exc := fut.exception()) is not None]
        self._stats.errors.extend(failures)
        if failures:
            raise failures[0]
        return self._stats.stored_chunks

    @property
    def store_errors(self) -> tuple[BaseException, ...]:
        """Every background store failure collected by :meth:`wait_stored` so far."""
        return tuple(self._stats.errors)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # -- steps --------------------------------------------------------------------------------

    def _match(self, hashes: list[bytes]) -> tuple[int, list[str]]:
        if not hashes:
            return 0, []
        if callable(getattr(self.client, "match_tiers", None)):
            res = self.client.match_tiers(self.namespace, hashes)  # type: ignore[attr-defined]
            return int(res.matched), [str(t) for t in res.tiers]
        return int(self.client.match(self.namespace, hashes)), []

    def _layout(self, tokens: int) -> ChunkLayout:
        g = self.geometry
        return ChunkLayout(g.layers, g.kv_heads, g.head_dim, tokens, g.dtype, self.codec)

    def _load(self, hashes: list[bytes], want: int) -> DynamicCache:
        """A cache holding the first ``want`` tokens (fewer if a chunk vanished since the
        match), decoded from ``hashes``' chunks into tensors preallocated for all of them."""
        cache = DynamicCache(config=self.model.config)
        if want == 0:
            return cache
        g, c = self.geometry, self.chunk_tokens
        device = next(self.model.parameters()).device
        shape = (1, g.kv_heads, len(hashes) * c, g.head_dim)
        keys = [torch.empty(shape, dtype=g.dtype, device=device) for _ in range(g.layers)]
        values = [torch.empty(shape, dtype=g.dtype, device=device) for _ in range(g.layers)]
        done = self._fill_leased(hashes, keys, values) if self.load != "mget" else 0
        if done < len(hashes):
            done += self._fill_received(hashes[done:], keys, values, done)
        reuse = min(want, done * c)
        if reuse == 0:
            return cache
        for layer, k, v in zip(_dynamic_layers(cache), keys, values, strict=True):
            k, v = k[:, :, :reuse], v[:, :, :reuse]
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        return cache

    def _decode(self, payload: Any, index: int, keys: list[Any], values: list[Any]) -> None:
        sl = slice(index * self.chunk_tokens, (index + 1) * self.chunk_tokens)
        expect = self._layout(self.chunk_tokens)
        unpack_into(payload, [k[0, :, sl] for k in keys], [v[0, :, sl] for v in values], expect)

    def _fill_leased(self, hashes: list[bytes], keys: list[Any], values: list[Any]) -> int:
        """Zero-copy path: lease the chunks and decode from the shared region in place.
        Returns how many leading chunks were decoded (0 when leases cannot be mapped here)."""
        lease_fn = getattr(self.client, "lease", None)
        if not callable(lease_fn):
            return 0
        try:
            lease = lease_fn(self.namespace, hashes)
            if lease is None:
                return 0
            try:
                payloads = _lease_payloads(lease)
                for i, payload in enumerate(payloads):
                    self._decode(payload, i, keys, values)
                return len(payloads)
            finally:
                lease.release()  # waits for the decode's copies out of cuda chunks first
        except RegionMapError:
            if self.load == "lease":
                raise
            self.load = "mget"  # another host, or GPU handles in a process without CUDA
            return 0

    def _fill_received(
        self, hashes: list[bytes], keys: list[Any], values: list[Any], first: int
    ) -> int:
        """One ``KV.MGET`` received into a kept staging buffer, then decoded."""
        size = packed_size(self._layout(self.chunk_tokens))
        buf = self._staging(size * len(hashes))
        outs = [buf[i * size : (i + 1) * size] for i in range(len(hashes))]
        payloads = self.client.mget(self.namespace, hashes, outs=outs)
        for i, payload in enumerate(payloads):
            if payload is None:  # evicted between match and get: compute from here on
                return i
            self._decode(payload, first + i, keys, values)
        return len(payloads)

    @torch.inference_mode()
    def _forward(self, ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        device = next(self.model.parameters()).device
        kwargs = {self._cache_kw: cache, "use_cache": True, "logits_to_keep": 1}
        out = self.model(input_ids=ids.to(device), **kwargs)
        return out.logits[0, -1].float()

    def _store_async(self, cache: DynamicCache, hashes: list[bytes], first: int, end: int) -> None:
        """Capture views of chunks ``first..end`` now (DynamicLayer grows by concatenation, so
        they never change) and encode and store them on the background thread."""
        c = self.chunk_tokens
        views = [(layer.keys, layer.values) for layer in _dynamic_layers(cache)]
        parents = [b"", *hashes[:-1]]
        jobs = [(hashes[i], parents[i], slice(i * c, (i + 1) * c)) for i in range(first, end)]
        self._pending.append(self._pool.submit(self._store_chunks, views, jobs))

    def _store_chunks(
        self, views: list[tuple[Any, Any]], jobs: list[tuple[bytes, bytes, slice]]
    ) -> int:
        if self.store_in_place:
            try:
                return self._store_in_place(views, jobs)
            except RegionMapError:
                self.store_in_place = False  # the server is on another host
        stored = 0
        for h, parent, sl in jobs:
            payload = pack_chunk(*self._chunk(views, sl), self.codec)
            self._store_client.put(self.namespace, h, parent, payload, tokens=sl.stop - sl.start)
            stored += 1
            self._stats.stored_chunks += 1
        return stored

    def _chunk(self, views: list[tuple[Any, Any]], sl: slice) -> tuple[list[Any], list[Any]]:
        return [k[0, :, sl] for k, _ in views], [v[0, :, sl] for _, v in views]

    def _store_in_place(
        self, views: list[tuple[Any, Any]], jobs: list[tuple[bytes, bytes, slice]]
    ) -> int:
        """Encode the chain straight into slots reserved for it (one KV.MRESERVE and one
        KV.COMMIT per batch); chunks stored already count as stored, as with KV.PUT."""
        size = packed_size(self._layout(self.chunk_tokens))
        reserve_chain = self._store_client.reserve_chain  # type: ignore[attr-defined]
        stored = 0
        for part in batch_slices([size] * len(jobs)):
            batch_jobs = jobs[part]
            hashes = [h for h, _, _ in batch_jobs]
            with reserve_chain(self.namespace, batch_jobs[0][1], hashes, [size] * len(hashes),
                               tokens=self.chunk_tokens) as batch:  # fmt: skip
                for i in batch.reserved:
                    pack_into(batch.tensor(i), *self._chunk(views, batch_jobs[i][2]), self.codec)
            done = sum(state != "busy" for state in batch.states)
            stored += done
            self._stats.stored_chunks += done
        return stored


def _lease_payloads(lease: Any) -> list[Any]:
    """What the decoder reads a leased chunk from: a memoryview of an ``shm`` handle, a CUDA
    tensor of a ``cuda`` handle (a server with a GPU tier leases from its pool by default,
    and ``views()`` cannot show device memory)."""
    payloads = getattr(lease, "payloads", None)
    return list(payloads()) if callable(payloads) else list(lease.views())
