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
from typing import Any, Concatenate, ParamSpec, TypeVar

from kvstrata.clients import commands as cmd
from kvstrata.clients.aio_leases import AsyncLease, AsyncWriteBatch, AsyncWriteLease
from kvstrata.clients.aioconn import AsyncConnection, AsyncConnectionPool
from kvstrata.clients.commands import Call, HashLike
from kvstrata.clients.connection import (
    LEASE_CONN_CLOSED,
    ConnectionSettings,
    loading_delays,
    settings_from_url,
)
from kvstrata.clients.handles import RegionMapError, lease_tier
from kvstrata.clients.leases import batch_slices, put_states
from kvstrata.clients.pipeline import PipelineBase
from kvstrata.clients.regions import regions_stale, update_regions
from kvstrata.clients.resp import as_bytes_view
from kvstrata.clients.results import BatchGrant, Handle, LeaseId, RegionInfo
from kvstrata.protocol.errors import LeaseError, LeaseLimitError, LoadingError, RespError

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


#: the next batch of a chain, reserved with the commit of one (``put_chain``): its hashes,
#: sizes, parent and tokens
_Next = tuple[Sequence[HashLike], Sequence[int], HashLike, int]


async def _fill(
    batch: AsyncWriteBatch, srcs: Sequence[Any], nxt: _Next | None
) -> tuple[list[str], AsyncWriteBatch | None]:
    """Copy ``srcs`` into the slots, then commit with the reservation of ``nxt`` (see
    ``sync._fill``)."""
    for i in batch.reserved:
        batch.write(i, srcs[i])
    ahead = None if nxt is None else await batch.commit_then_reserve(nxt)
    return put_states(batch.states), ahead


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
        self._digests = True  # False once the server turned KV.COMMIT … DIGEST down
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

    async def _run(self, call: Call[T], via: AsyncConnection | None = None) -> T:
        return (await self._take(call, via))[0]

    async def _take(
        self, call: Call[T], via: AsyncConnection | None = None
    ) -> tuple[T, AsyncConnection]:
        """The result of ``call`` run on ``via`` (default: a pooled connection; ``via`` may be
        in use by other tasks too: replies come back in order), and the connection it ran on
        (a lease taken is that connection's)."""
        delays = None
        while True:
            if via is not None:
                if via.closed:
                    raise LeaseError(LEASE_CONN_CLOSED)
                conn, reply = via, (await via.pipeline([call.args], [call.out]))[0]
            else:
                async with self.pool.connection() as conn:
                    reply = (await conn.pipeline([call.args], [call.out]))[0]
            if type(reply) is not LoadingError:
                return call.result(reply), conn
            # the server is still building its tiers: nothing was done, send it again
            delays = delays or loading_delays(self.settings.loading_timeout)
            delay = next(delays, None)
            if delay is None:
                raise reply  # still loading after loading_timeout seconds
            await asyncio.sleep(delay)

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
        grant, conn = await self._take(cmd.lease(ns, hashes, ttl_ms, lease_tier(tier)))
        if grant is None:
            return None
        try:
            regions = await self._regions_for(grant.handles)
            keys = [bytes(cmd.hash_bytes(h)) for h in hashes]
            return AsyncLease(self, ns, keys, grant, regions, conn=conn)
        except BaseException:
            await self.release(grant.lease_id, via=conn)  # not pinned until the TTL
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
        call = cmd.reserve(ns, hash, parent, nbytes, tokens, ttl_ms, tier)
        grant, conn = await self._take(call)
        try:
            regions = await self._regions_for((grant.handle,))
            key = bytes(cmd.hash_bytes(hash))
            return AsyncWriteLease(self, ns, key, grant, regions, conn=conn)
        except BaseException:
            await self.abort(grant.lease_id, via=conn)  # free the slot now, not at the TTL
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
        call = cmd.mreserve(ns, parent, hashes, sizes, tokens, ttl_ms, tier)
        grant, conn = await self._take(call)
        return await self._write_batch(ns, hashes, grant, conn)

    async def _write_batch(
        self, ns: str, hashes: Sequence[HashLike], grant: BatchGrant, conn: AsyncConnection
    ) -> AsyncWriteBatch:
        """The batch of a KV.MRESERVE reply; its lease is aborted when that fails."""
        try:
            regions = await self._regions_for([h for h in grant.handles if h is not None])
            keys = [bytes(cmd.hash_bytes(h)) for h in hashes]
            return AsyncWriteBatch(self, ns, keys, grant, regions, conn=conn)
        except BaseException:
            if grant.lease_id is not None:
                await self.abort(grant.lease_id, via=conn)  # free the slots now, not at the TTL
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
        sizes = [len(b) for b in srcs]
        parts = batch_slices(sizes)
        out: list[str] = []
        ahead: AsyncWriteBatch | None = None  # this part's slots, reserved with the last commit
        for k, part in enumerate(parts):
            nxt: _Next | None = None
            if k + 1 < len(parts):
                following = parts[k + 1]
                nxt = (hashes[following], sizes[following], hashes[following.start - 1], tokens)
            if ahead is None:
                link = parent if part.start == 0 else hashes[part.start - 1]
                states, ahead = await self._put_batch(
                    ns, hashes[part], srcs[part], link, tokens, nxt
                )
            else:
                batch, ahead = ahead, None
                async with batch:  # an exception while filling aborts the slots
                    states, ahead = await _fill(batch, srcs[part], nxt)
            out += states
        return out

    async def _put_batch(
        self,
        ns: str,
        hashes: Sequence[HashLike],
        srcs: Sequence[Any],
        parent: Any,
        tokens: int,
        nxt: _Next | None = None,
    ) -> tuple[list[str], AsyncWriteBatch | None]:
        """One batch, halved on -LEASELIMIT; ``nxt`` reserved with its commit where it can be
        (see :meth:`kvstrata.clients.Client._put_batch`)."""
        try:
            return await self._put_batch_once(ns, hashes, srcs, parent, tokens, nxt)
        except LeaseLimitError:
            if len(hashes) < 2:
                raise
        mid = len(hashes) // 2
        first, _ = await self._put_batch(ns, hashes[:mid], srcs[:mid], parent, tokens)
        rest, ahead = await self._put_batch(
            ns, hashes[mid:], srcs[mid:], hashes[mid - 1], tokens, nxt
        )
        return first + rest, ahead

    async def _put_batch_once(
        self,
        ns: str,
        hashes: Sequence[HashLike],
        srcs: Sequence[Any],
        parent: Any,
        tokens: int,
        nxt: _Next | None,
    ) -> tuple[list[str], AsyncWriteBatch | None]:
        if self.shared_memory:
            sizes = [len(b) for b in srcs]
            try:
                batch = await self.reserve_chain(ns, parent, hashes, sizes, tokens, tier="dram")
                async with batch:
                    return await _fill(batch, srcs, nxt)
            except RegionMapError:
                self.shared_memory = False  # the server is on another host: bytes over TCP
        p = self.pipeline()
        for h, src in zip(hashes, srcs, strict=True):
            p.put(ns, h, parent, src, tokens=tokens, nx=True)
            parent = h
        return ["stored" if ok else "exists" for ok in await p.execute()], None

    async def _commit_then_reserve(
        self, batch: AsyncWriteBatch, nxt: _Next, conn: AsyncConnection
    ) -> AsyncWriteBatch | None:
        """``AsyncWriteBatch.commit_then_reserve`` (see ``Client._commit_then_reserve``)."""
        hashes, sizes, parent, tokens = nxt
        named, digests = batch.commit_args(())
        if not self._digests:
            digests = ()
        commit = cmd.commit(batch._lease(), *named, digests=digests)
        reserve = cmd.mreserve(batch.namespace, parent, hashes, sizes, tokens, tier="dram")
        if conn.closed:
            raise LeaseError(LEASE_CONN_CLOSED)
        done, reply = await conn.pipeline([commit.args, reserve.args], [None, None])
        grant = None if isinstance(reply, RespError) else reserve.result(reply)
        try:
            if isinstance(done, RespError):
                if not (digests and cmd.refuses_digests(done)):
                    raise done
                self._digests = False  # an older server: it hashes the slots itself
                await self._run(cmd.commit(batch._lease(), *named), conn)
        except BaseException:
            if grant is not None and grant.lease_id is not None:
                await self.abort(grant.lease_id, via=conn)  # nothing of the next batch is kept
            raise
        if grant is None:
            return None  # refused: the caller reserves that batch again and hears why
        try:
            return await self._write_batch(batch.namespace, hashes, grant, conn)
        except Exception:  # its lease is aborted; reserved again, the error is raised then
            return None

    async def commit(
        self,
        lease_id: LeaseId,
        *indexes: int,
        via: AsyncConnection | None = None,
        digests: Sequence[bytes] = (),
    ) -> None:
        """``KV.COMMIT lease [index…] [DIGEST digest…]`` on ``via``, the connection that took
        the lease (see :meth:`kvstrata.clients.Client.commit`)."""
        if digests and self._digests:
            try:
                await self._run(cmd.commit(lease_id, *indexes, digests=digests), via)
                return
            except RespError as exc:
                if not cmd.refuses_digests(exc):
                    raise
                self._digests = False  # an older server: it hashes the slots itself
        await self._run(cmd.commit(lease_id, *indexes), via)

    async def abort(self, lease_id: LeaseId, via: AsyncConnection | None = None) -> None:
        await self._run(cmd.abort(lease_id), via)

    async def release(self, lease_id: LeaseId, via: AsyncConnection | None = None) -> None:
        await self._run(cmd.release(lease_id), via)

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
