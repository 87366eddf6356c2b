"""The S3 tier: one object per chunk in any S3-compatible store (AWS S3, MinIO, Ceph) via boto3.

Every boto3 call runs on a bounded executor of ``max_connections`` threads (the requests are in
:mod:`kvstrata.tiers.s3_requests`). Reads land in the caller's buffer (``readinto`` in steps,
short reads checked). The bucket is untrusted: every object is judged by its own metadata,
validated like a client's KV.PUT, and with ``auth_key`` (``s3-auth-key``) by its keyed tags
(:mod:`kvstrata.tiers.s3_auth`). An object that fails is a miss, counted (``invalid_objects``,
``auth_failures``) and left in the bucket; only an object whose bytes disagree with its own
metadata is deleted (that version only, ``IfMatch`` on its ETag) and raises
:class:`IntegrityError`. A valid object of another size than expected (another node replaced
it) raises :class:`ObjectChanged` carrying its metadata. Failures
(endpoint down, timeouts, 5xx after botocore's retries) raise :class:`TierIOError`, bounded by
``timeout`` per attempt and ``retries``; a failure of the endpoint opens a short circuit breaker.

Object names and metadata are in :mod:`kvstrata.tiers.s3_objects`; error translation, the negative
cache and the breaker in :mod:`kvstrata.tiers.s3_failures`; the objects the tier knows of, its
misses and its verdicts on rejected and corrupt objects in :mod:`kvstrata.tiers.s3_known`.
``docs/s3.md`` describes the layout, consistency and failures.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, TypeVar

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.tiers.base import (
    Buffer,
    ChunkMissing,
    IntegrityError,
    ObjectChanged,
    Tier,
    TierIOError,
    TierUnavailable,
    register_tier,
)
from kvstrata.tiers.s3_auth import ObjectAuth
from kvstrata.tiers.s3_config import S3Config, connect
from kvstrata.tiers.s3_failures import Breaker, NegativeCache, translate_error
from kvstrata.tiers.s3_known import KnownObjects
from kvstrata.tiers.s3_objects import (  # these and NegativeCache: tests import them from here
    FORMAT_VERSION,
    AuthFailure,
    CorruptObject,
    InvalidObject,
    SessionObject,
    decode_metadata,
    encode_metadata,
    object_name,
    parse_object_name,
    session_name,
)
from kvstrata.tiers.s3_requests import Head, S3Requests

try:
    from boto3.exceptions import Boto3Error
    from botocore.exceptions import BotoCoreError, ClientError
except ImportError:  # pragma: no cover - boto3 is the optional [s3] extra
    HAVE_BOTO3 = False
else:
    HAVE_BOTO3 = True

__all__ = [
    "FORMAT_VERSION", "CorruptObject", "NegativeCache", "S3Config", "S3Tier", "decode_metadata",
    "encode_metadata", "object_name", "parse_object_name",
]  # fmt: skip
log = logging.getLogger(__name__)
#: counters of ``stats.extra`` shown by info() (INFO tiers: ``s3_invalid_objects``…)
_SHOWN = ("invalid_objects", "auth_failures", "kept_objects", "sessions_written", "sessions_read")
_UNUSABLE_BUCKET = frozenset({"404", "NoSuchBucket", "403", "AccessDenied", "Forbidden"})
T = TypeVar("T")


class S3Tier(KnownObjects, Tier):
    """Chunks as S3 objects; see the module docstring. Capacity is unbounded (0)."""

    name = "s3"
    persistent = True
    #: shared by every node of a cluster (the store's ``is_shared``)
    shared: ClassVar[bool] = True

    def __init__(self, config: S3Config) -> None:
        super().__init__()
        if not HAVE_BOTO3:
            raise TierUnavailable("s3 tier needs boto3: pip install 'kvstrata[s3]'")
        self.config = config
        self.prefix = config.prefix.strip("/")
        self._pool = ThreadPoolExecutor(config.max_connections, thread_name_prefix="kvstrata-s3")
        self._concurrency = min(4, config.max_connections)  # parts of one multipart upload
        self._client, transfer = connect(config, self._concurrency)
        auth = ObjectAuth(config.auth_key) if config.auth_key else None
        self._req = S3Requests(
            self._client, config.bucket, transfer, config.multipart_threshold, auth, config.codec
        )
        self._negative = NegativeCache(config.negative_ttl)
        self._breaker = Breaker(config.retry_after)
        self._sizes: dict[ChunkKey, int] = {}  # objects we know of: put, read or scanned
        self._used = 0
        self._closed = False
        self._logged = 0.0
        self.stats.extra.update(
            negative_hits=0, multipart_puts=0, invalid_objects=0, auth_failures=0,
            kept_objects=0, sessions_written=0, sessions_read=0, coded_puts=0,
            coded_bytes_saved=0,
        )  # fmt: skip
        self._check_bucket()

    def _check_bucket(self) -> None:
        """A bucket that does not exist (or may not be used) stops start-up with a message; an
        endpoint that does not answer does not (an S3 outage degrades to misses)."""
        where = self.config.endpoint or f"AWS {self.config.region}"
        try:
            self._client.head_bucket(Bucket=self.config.bucket)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in _UNUSABLE_BUCKET:
                self._pool.shutdown(wait=False)
                raise TierUnavailable(
                    f"s3-bucket {self.config.bucket!r} is not usable at {where} ({code}): "
                    "create it, or fix s3-bucket / s3-endpoint / the credentials"
                ) from None
            log.warning("s3: checking bucket %r at %s failed: %s", self.config.bucket, where, code)
        except (BotoCoreError, OSError) as exc:
            log.warning(
                "s3: %s did not answer at start (%s); serving from the local tiers until it does",
                where,
                type(exc).__name__,
            )

    @property
    def capacity(self) -> int:
        return 0

    @property
    def used(self) -> int:
        return self._used

    # -- async contract -------------------------------------------------------------------

    async def put(self, meta: ChunkMeta, data: Buffer) -> None:
        nbytes = memoryview(data).nbytes
        if nbytes != meta.size:
            raise ValueError(f"payload is {nbytes} bytes, meta says {meta.size}")
        name = object_name(self.prefix, meta.key)
        started = time.perf_counter()
        self._negative.wrote(meta.key)
        if nbytes >= self.config.multipart_threshold:
            self.stats.extra["multipart_puts"] += 1
        try:
            stored = await self._call("put", self._req.put, name, meta, data)
        finally:
            self._negative.wrote(meta.key)  # a HEAD that raced the upload must not cache a miss
        self.stats.seconds_in += time.perf_counter() - started
        self.stats.puts += 1
        self.stats.bytes_in += meta.size
        if stored < meta.size:
            self.stats.extra["coded_puts"] += 1
            self.stats.extra["coded_bytes_saved"] += meta.size - stored
        self._remember(meta.key, meta.size)

    async def get(self, key: ChunkKey, out: memoryview) -> ChunkMeta:
        if self._negative.hit(key):
            self.stats.extra["negative_hits"] += 1
            self.stats.misses += 1
            raise ChunkMissing(key)
        since, started = self._negative.seq(), time.perf_counter()
        name = object_name(self.prefix, key)
        try:
            head: Head = await self._call("get", self._req.get, key, name, out)
        except ChunkMissing:
            self._missed(key, since)
            raise
        except (InvalidObject, AuthFailure) as exc:
            self._rejected(key, since, exc)
            raise ChunkMissing(key) from None
        except CorruptObject as exc:
            await self._quarantine(key, name, exc)
            raise IntegrityError(f"s3 chunk {key.namespace}/{key.hex}: {exc.args[0]}") from None
        except ObjectChanged as exc:
            self._remember(key, exc.meta.size)
            raise
        meta = head.meta
        if meta is None:
            self._missed(key, since)
            raise ChunkMissing(key)
        self.stats.seconds_out += time.perf_counter() - started
        self.stats.hits += 1
        self.stats.bytes_out += meta.size
        self._remember(key, meta.size)
        return meta

    async def delete(self, key: ChunkKey) -> bool:
        """Delete the chunk's object if it is a valid one (that version only: an object that
        another node wrote meanwhile, or one this node may not judge, stays)."""
        since = self._negative.seq()
        head = await self._head(key)
        existed = head is not None and head.meta is not None
        if head is not None and existed:
            name = object_name(self.prefix, key)
            if await self._call("delete", self._req.delete_version, name, head.etag):
                self.stats.deletes += 1
            else:
                self.stats.extra["kept_objects"] += 1
        self._forget(key)
        self._negative.miss(key, since)
        return existed

    async def contains(self, key: ChunkKey) -> bool:
        return await self.meta(key) is not None

    async def meta(self, key: ChunkKey) -> ChunkMeta | None:
        if self._negative.hit(key):
            self.stats.extra["negative_hits"] += 1
            return None
        since = self._negative.seq()
        head = await self._head(key)
        meta = None if head is None else head.meta
        if meta is None:
            self._missed(key, since)
        else:
            self._remember(key, meta.size)
        return meta

    async def put_session(self, obj: SessionObject) -> None:
        """Record a session (``KV.SESSION``) for every node: a small object beside the chunks."""
        name = session_name(self.prefix, obj.namespace, obj.id)
        await self._call("put", self._req.put_session, name, obj)
        self.stats.extra["sessions_written"] += 1

    async def get_session(self, ns: str, session: bytes, max_ttl_ms: int) -> SessionObject | None:
        """The session another node recorded; None when absent, expired, invalid (any field,
        an expiry more than ``max_ttl_ms`` ahead included) or not authentic (the last two
        counted and logged). Raises TierError when S3 fails."""
        name = session_name(self.prefix, ns, session)
        get = self._req.get_session
        try:
            obj: SessionObject = await self._call("get", get, name, ns, session, max_ttl_ms)
        except ChunkMissing:
            return None
        except (InvalidObject, AuthFailure) as exc:
            self._count_rejected(name, exc)
            return None
        if obj.ttl_ms() <= 0:
            return None
        self.stats.extra["sessions_read"] += 1
        return obj

    async def contains_many(self, keys: Iterable[ChunkKey]) -> list[bool]:
        """Presence of each key, at most ``max_connections`` HEADs in flight for this call."""
        return await self._probe(list(keys), stop_at_miss=False)

    async def match_length(self, keys: Sequence[ChunkKey]) -> int:
        """Length of the longest present prefix of a hash chain (cross-node KV.MATCH); stops
        probing after the first window of ``max_connections`` keys that holds a miss."""
        found = await self._probe(keys, stop_at_miss=True)
        return found.index(False) if False in found else len(found)

    async def scan_keys(self) -> AsyncIterator[tuple[ChunkKey, int]]:
        """(key, size) of every object under the prefix, from listings only (no HEADs)."""
        token: str | None = None
        while True:
            page, token = await self._call("list", self._req.list_page, self.prefix, token)
            for name, size in page:
                key = parse_object_name(self.prefix, name)
                if key is not None:
                    yield key, size
            if token is None:
                return

    async def scan(self) -> AsyncIterator[ChunkMeta]:
        """Metadata of every chunk under the prefix (one HEAD per object: slow for big buckets)."""
        batch: list[ChunkKey] = []
        async for key, _size in self.scan_keys():
            batch.append(key)
            if len(batch) >= self.config.max_connections:
                for meta in await asyncio.gather(*(self.meta(k) for k in batch)):
                    if meta is not None:
                        yield meta
                batch = []
        for meta in await asyncio.gather(*(self.meta(k) for k in batch)):
            if meta is not None:
                yield meta

    def info(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "endpoint": cfg.endpoint or f"aws:{cfg.region}",
            "bucket": cfg.bucket,
            "prefix": self.prefix,
            "write_policy": cfg.write_policy,
            "max_connections": cfg.max_connections,
            "timeout": cfg.timeout,
            "multipart_threshold": cfg.multipart_threshold,
            "known_objects": len(self._sizes),
            "negative_cache": len(self._negative),
            "breaker": "open" if self._breaker.open else "closed",
            "breaker_trips": self._breaker.trips,
            "breaker_rejections": self._breaker.rejected,
            "format_version": FORMAT_VERSION,
            "codec": cfg.codec,
            "auth": "on" if self._req.auth is not None else "off",
            **{k: self.stats.extra[k] for k in _SHOWN},
        }

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.get_running_loop().run_in_executor(None, self._pool.shutdown, True)
        self._client.close()

    # -- internals ------------------------------------------------------------------------

    async def _call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a blocking boto3 call on the pool; map failures to tier errors."""
        if self._closed:
            raise TierUnavailable("s3 tier is closed")
        try:
            self._breaker.check()
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))
        except TierIOError:
            self.stats.errors += 1
            raise
        except (ClientError, BotoCoreError, Boto3Error, OSError) as exc:
            err, endpoint_failed = translate_error(exc, what)
            if endpoint_failed:
                self._breaker.trip(str(err))
            if isinstance(err, TierIOError):
                self.stats.errors += 1
            raise err from exc

    async def _probe(self, keys: Sequence[ChunkKey], stop_at_miss: bool) -> list[bool]:
        window, found = self.config.max_connections, []
        for start in range(0, len(keys), window):
            found += await asyncio.gather(*(self.contains(k) for k in keys[start : start + window]))
            if stop_at_miss and not all(found):
                break
        return found

    async def _head(self, key: ChunkKey) -> Head | None:
        """HEAD → the object's judged metadata; None when absent or rejected (counted)."""
        try:
            head: Head = await self._call(
                "head", self._req.head, key, object_name(self.prefix, key)
            )
        except ChunkMissing:
            return None
        except (InvalidObject, AuthFailure) as exc:
            self._count_rejected(object_name(self.prefix, key), exc)  # the caller: a miss
            return None
        return head


# Registered by call rather than as a decorator so that type checkers keep the class type.
register_tier("s3")(S3Tier)
