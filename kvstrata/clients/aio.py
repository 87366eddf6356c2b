"""The asyncio kvstrata client: the typed ``KV.*`` methods of :class:`~kvstrata.clients.Client`,
awaited, over a pool of :class:`~kvstrata.clients.aioconn.AsyncConnection`.

    async with AsyncClient(port=7379) as kv:
        n = await kv.match(ns, hashes)
        view = await kv.get(ns, hashes[0], out=tensor)
        async with await kv.lease(ns, hashes[:n]) as lease:
            arrays = lease.arrays(np.float16)

Create it inside the event loop that uses it (``await AsyncClient.connect(...)`` or
``async with``); connections are opened lazily, at most ``max_connections`` at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Self, TypeVar

from kvstrata.clients import commands as cmd
from kvstrata.clients.aioconn import AsyncConnectionPool
from kvstrata.clients.commands import Call, HashLike
from kvstrata.clients.connection import ConnectionSettings
from kvstrata.clients.handles import RegionMapError, lease_tier
from kvstrata.clients.leases import (
    Fence,
    LeaseBase,
    WriteBatchBase,
    WriteLeaseBase,
    batch_slices,
    put_states,
    run_fence,
)
from kvstrata.clients.pipeline import PipelineBase
from kvstrata.clients.regions import regions_stale, update_regions
from kvstrata.clients.resp import as_bytes_view
from kvstrata.clients.results import Handle, RegionInfo
from kvstrata.clients.sync import settings_from_url
from kvstrata.protocol.errors import RespError

__all__ = [
    "AsyncClient",
    "AsyncLease",
    "AsyncPipeline",
    "AsyncWriteBatch",
    "AsyncWriteLease",
]

T = TypeVar("T")
P = ParamSpec("P")


def _command(
    build: Callable[P, Call[T]],
) -> Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, T]]:
    """An :class:`AsyncClient` method that sends the command ``build`` makes and returns its
    result."""

    async def method(self: AsyncClient, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self._run(build(*args, **kwargs))

    return cmd.method_like(build, method)


async def _wait(fence: Fence | None, strict: bool = False) -> None:
    """Wait off the event loop: the streams were captured on the caller's thread."""
    if fence is not None:
        await asyncio.to_thread(run_fence, fence, strict)


class AsyncLease(LeaseBase):
    """A read lease; ``async with`` releases it."""

    __slots__ = ("_client",)

    def __init__(self, client: AsyncClient, *args: Any) -> None:
        super().__init__(*args)
        self._client = client

    async def release(self) -> None:
        if not self.done:
            await _wait(self.fence())  # the engine's queued copies out of the slots come first
            self.done = True
            await self._client.release(self.lease_id)

    async def __aenter__(self) -> AsyncLease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()


class _CommitOnExit:
    """``async with``: commit on success (unless done already), abort on an exception."""

    __slots__ = ()
    done: bool

    if TYPE_CHECKING:

        async def commit(self) -> None: ...
        async def abort(self) -> None: ...

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if et is None:
            if not self.done:
                await self.commit()
        else:
            await self.abort()


class AsyncWriteLease(_CommitOnExit, WriteLeaseBase):
    """A reserved slot; ``async with`` commits on success and aborts on an exception."""

    __slots__ = ("_client",)

    def __init__(self, client: AsyncClient, *args: Any) -> None:
        super().__init__(*args)
        self._client = client

    async def commit(self) -> None:
        if self.done:
            raise RuntimeError("this write lease is already committed or aborted")
        try:  # the server checksums the slot: the engine's writes must be done
            await _wait(self.fence(), strict=True)
        except Exception:
            await self.abort()  # never publish bytes not known to be complete
            raise
        self.done = True
        await self._client.commit(self.lease_id)

    async def abort(self) -> None:
        if not self.done:
            await _wait(self.fence())  # a queued write must not land in the slot's next tenant
            self.done = True
            await self._client.abort(self.lease_id)


class AsyncWriteBatch(_CommitOnExit, WriteBatchBase):
    """Reserved slots of a chain; ``async with`` commits them all on success and aborts them
    all on an exception."""

    __slots__ = ("_client", "_sent")

    def __init__(self, client: AsyncClient, *args: Any) -> None:
        super().__init__(*args)
        self._client = client
        self._sent: list[asyncio.Future[Any]] = []

    async def publish(self, *indexes: int) -> None:
        """Publish chunks now (see :meth:`kvstrata.clients.sync.WriteBatch.publish`):
        ``KV.COMMIT lease i…`` is sent from a task; commit/abort wait for the replies."""
        if self.done:
            raise RuntimeError("this write batch is already committed or aborted")
        self._check_unpublished(indexes)
        await _wait(self.fence(), strict=True)
        sent = self._client.execute("KV.COMMIT", self._lease(), *indexes)
        self._sent.append(asyncio.ensure_future(sent))
        self.published.append(indexes)

    async def _collect(self) -> BaseException | None:
        sent, self._sent = self._sent, []
        results = await asyncio.gather(*sent, return_exceptions=True)
        return next((r for r in results if isinstance(r, BaseException)), None)

    async def commit(self) -> None:
        if self.done:
            raise RuntimeError("this write batch is already committed or aborted")
        try:  # the server checksums the slots: the engine's writes must be done
            await _wait(self.fence(), strict=True)
        except Exception:
            await self.abort()  # never publish bytes not known to be complete
            raise
        self.done = True
        error = await self._collect()
        if error is not None:
            if self.unpublished():
                try:  # do not leave the rest reserved until the TTL
                    await self._client.abort(self._lease())
                except (OSError, RespError):
                    pass
            raise error
        if self.unpublished():
            await self._client.commit(self._lease())

    async def abort(self) -> None:
        """Discard the chunks not published yet (those published stay stored)."""
        if not self.done:
            await _wait(self.fence())  # a queued write must not land in a slot's next tenant
            self.done = True
            await self._collect()
            if self.unpublished():
                await self._client.abort(self._lease())


class AsyncPipeline(PipelineBase):
    """Commands sent in one write on one connection; ``await execute()`` returns results."""

    def __init__(self, client: AsyncClient) -> None:
        super().__init__()
        self._client = client

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        calls = self._take()
        if not calls:
            return []
        async with self._client.pool.connection() as conn:
            replies = await conn.pipeline([c.args for c in calls], [c.out for c in calls])
        return self._decode(calls, replies, raise_on_error)

    async def __aenter__(self) -> AsyncPipeline:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._calls = []


class AsyncClient:
    """Async client; see the module docstring. Arguments as :class:`ConnectionSettings`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 7379, **kwargs: Any) -> None:
        max_connections = kwargs.pop("max_connections", 8)
        self.settings = ConnectionSettings(host=host, port=port, **kwargs)
        self.pool = AsyncConnectionPool(self.settings, max_connections)
        self._regions: dict[str, RegionInfo] = {}
        self._regions_generation = -1
        self.shared_memory = True  # see Client.shared_memory

    @classmethod
    async def connect(cls, host: str = "127.0.0.1", port: int = 7379, **kwargs: Any) -> AsyncClient:
        """Create the client and open its first connection (fails fast on a wrong address)."""
        client = cls(host, port, **kwargs)
        client.pool.release(await client.pool.acquire())
        return client

    @classmethod
    async def from_url(cls, url: str, **kwargs: Any) -> AsyncClient:
        return await cls.connect(**settings_from_url(url, **kwargs))

    async def _run(self, call: Call[T]) -> T:
        async with self.pool.connection() as conn:
            reply = (await conn.pipeline([call.args], [call.out]))[0]
        return call.result(reply)

    async def execute(self, *args: Any, out: Any = None) -> Any:
        return await self._run(cmd.raw(args, out))

    def pipeline(self) -> AsyncPipeline:
        return AsyncPipeline(self)

    ping = _command(cmd.ping)
    put = _command(cmd.put)
    get = _command(cmd.get)
    mget = _command(cmd.mget)
    match = _command(cmd.match)
    match_tiers = _command(cmd.match_tiers)
    match_tokens = _command(cmd.match_tokens)

    async def regions(self, refresh: bool = True) -> list[RegionInfo]:
        if refresh or not self._regions:
            await self._refresh_regions(())
        return list(self._regions.values())

    async def _refresh_regions(self, handles: Sequence[Handle]) -> None:
        generation = self.pool.generation
        fresh = await self._run(cmd.regions())
        self._regions = update_regions(self._regions, fresh, handles)
        self._regions_generation = generation

    async def _regions_for(self, handles: Sequence[Handle]) -> dict[str, RegionInfo]:
        # see Client._regions_for: a new connection or instance may mean a restarted server
        if self._regions_generation != self.pool.generation or regions_stale(
            self._regions, handles
        ):
            await self._refresh_regions(handles)
        return self._regions

    async def lease(
        self,
        ns: str,
        hashes: Sequence[HashLike],
        ttl_ms: int | None = None,
        tier: str | None = None,
    ) -> AsyncLease | None:
        """Pin chunks for zero-copy reads (see :meth:`kvstrata.clients.Client.lease`)."""
        grant = await self._run(cmd.lease(ns, hashes, ttl_ms, lease_tier(tier)))
        if grant is None:
            return None
        try:
            regions = await self._regions_for(grant.handles)
            return AsyncLease(self, ns, [bytes(cmd.hash_bytes(h)) for h in hashes], grant, regions)
        except BaseException:
            await self.release(grant.lease_id)  # don't leave the chunks pinned until the TTL
            raise

    async def reserve(
        self,
        ns: str,
        hash: HashLike,
        parent: HashLike | None,
        nbytes: int,
        tokens: int = 0,
        ttl_ms: int | None = None,
        tier: str | None = None,
    ) -> AsyncWriteLease:
        grant = await self._run(cmd.reserve(ns, hash, parent, nbytes, tokens, ttl_ms, tier))
        try:
            regions = await self._regions_for((grant.handle,))
            return AsyncWriteLease(self, ns, bytes(cmd.hash_bytes(hash)), grant, regions)
        except BaseException:
            await self.abort(grant.lease_id)  # free the reserved slot now, not at the TTL
            raise

    async def reserve_chain(
        self,
        ns: str,
        parent: HashLike | None,
        hashes: Sequence[HashLike],
        sizes: Sequence[int],
        tokens: int = 0,
        ttl_ms: int | None = None,
        tier: str | None = None,
    ) -> AsyncWriteBatch:
        """Slots for a chain in one round trip (see
        :meth:`kvstrata.clients.Client.reserve_chain`)."""
        grant = await self._run(cmd.mreserve(ns, parent, hashes, sizes, tokens, ttl_ms, tier))
        try:
            regions = await self._regions_for([h for h in grant.handles if h is not None])
            keys = [bytes(cmd.hash_bytes(h)) for h in hashes]
            return AsyncWriteBatch(self, ns, keys, grant, regions)
        except BaseException:
            if grant.lease_id is not None:
                await self.abort(grant.lease_id)  # free the reserved slots now, not at the TTL
            raise

    async def put_chain(
        self,
        ns: str,
        hashes: Sequence[HashLike],
        payloads: Sequence[Any],
        parent: HashLike | None = None,
        tokens: int = 0,
    ) -> list[str]:
        """Store a chain, skipping chunks stored already (see
        :meth:`kvstrata.clients.Client.put_chain`)."""
        if len(payloads) != len(hashes):
            raise ValueError("put_chain needs one payload per hash")
        srcs = [as_bytes_view(p) for p in payloads]
        out: list[str] = []
        for part in batch_slices([len(b) for b in srcs]):
            link = parent if part.start == 0 else hashes[part.start - 1]
            out += await self._put_batch(ns, hashes[part], srcs[part], link, tokens)
        return out

    async def _put_batch(
        self, ns: str, hashes: Sequence[HashLike], srcs: Sequence[Any], parent: Any, tokens: int
    ) -> list[str]:
        if self.shared_memory:
            sizes = [len(b) for b in srcs]
            try:
                batch = await self.reserve_chain(ns, parent, hashes, sizes, tokens, tier="dram")
                async with batch:
                    for i in batch.reserved:
                        batch.write(i, srcs[i])
                return put_states(batch.states)
            except RegionMapError:
                self.shared_memory = False  # the server is on another host: bytes over TCP
        p = self.pipeline()
        for h, src in zip(hashes, srcs, strict=True):
            p.put(ns, h, parent, src, tokens=tokens, nx=True)
            parent = h
        return ["stored" if ok else "exists" for ok in await p.execute()]

    commit = _command(cmd.commit)
    abort = _command(cmd.abort)
    release = _command(cmd.release)
    info = _command(cmd.info)
    delete = _command(cmd.delete)
    stats = _command(cmd.stats)

    async def close(self) -> None:
        await self.pool.close()

    async def __aenter__(self) -> AsyncClient:
        if not self.pool._all:
            self.pool.release(await self.pool.acquire())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
