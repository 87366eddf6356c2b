"""The async client's lease objects: a read :class:`AsyncLease`, a reserved slot
(:class:`AsyncWriteLease`) and the slots of a chain (:class:`AsyncWriteBatch`), the awaited
twins of :mod:`kvstrata.clients.sync_leases`, each ended on the connection that took it by its
:class:`~kvstrata.clients.aio.AsyncClient`, after the engine's queued copies (its fence).
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from kvstrata.clients.aioconn import AsyncConnection
from kvstrata.clients.leases import Fence, LeaseBase, WriteBatchBase, WriteLeaseBase, run_fence
from kvstrata.protocol.errors import LeaseError

if TYPE_CHECKING:
    from kvstrata.clients.aio import AsyncClient

__all__ = ["AsyncLease", "AsyncWriteBatch", "AsyncWriteLease"]


async def _wait(fence: Fence | None, strict: bool = False) -> None:
    """Wait off the event loop: the streams were captured on the caller's thread."""
    if fence is not None:
        await asyncio.to_thread(run_fence, fence, strict)


class AsyncLease(LeaseBase):
    """A read lease; ``async with`` releases it. ``conn``: the connection that took it."""

    __slots__ = ("_client", "_conn")

    def __init__(
        self, client: AsyncClient, *args: Any, conn: AsyncConnection | None = None
    ) -> None:
        super().__init__(*args)
        self._client = client
        self._conn = conn

    async def release(self) -> None:
        if not self.done:
            await _wait(self.fence())  # the engine's queued copies out of the slots come first
            self.done = True
            await self._client.release(self.lease_id, via=self._conn)

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
    """A reserved slot; ``async with`` commits on success and aborts on an exception.
    ``conn``: the connection that took it."""

    __slots__ = ("_client", "_conn")

    def __init__(
        self, client: AsyncClient, *args: Any, conn: AsyncConnection | None = None
    ) -> None:
        super().__init__(*args)
        self._client = client
        self._conn = conn

    async def commit(self) -> None:
        if self.done:
            raise RuntimeError("this write lease is already committed or aborted")
        try:  # the server checksums the slot: the engine's writes must be done
            await _wait(self.fence(), strict=True)
        except Exception:
            await self.abort()  # never publish bytes not known to be complete
            raise
        self.done = True
        await self._client.commit(self.lease_id, via=self._conn, digests=self.commit_digests())

    async def abort(self) -> None:
        if not self.done:
            await _wait(self.fence())  # a queued write must not land in the slot's next tenant
            self.done = True
            await self._client.abort(self.lease_id, via=self._conn)


class AsyncWriteBatch(_CommitOnExit, WriteBatchBase):
    """Reserved slots of a chain; ``async with`` commits them all on success and aborts them
    all on an exception. ``conn``: the connection that took the lease."""

    __slots__ = ("_client", "_conn")

    def __init__(
        self, client: AsyncClient, *args: Any, conn: AsyncConnection | None = None
    ) -> None:
        super().__init__(*args)
        self._client = client
        self._conn = conn

    async def publish(self, *indexes: int) -> None:
        """Publish chunks now and wait for the reply (see
        :meth:`kvstrata.clients.sync.WriteBatch.publish`: ``LeaseError`` when the lease
        expired, then stop using the batch's views)."""
        if self.done:
            raise RuntimeError("this write batch is already committed or aborted")
        self._check_unpublished(indexes)
        await _wait(self.fence(), strict=True)
        named, digests = self.commit_args(indexes)
        self.published.append(indexes)
        await self._client.commit(self._lease(), *named, via=self._conn, digests=digests)

    async def commit(self) -> None:
        if self.done:
            raise RuntimeError("this write batch is already committed or aborted")
        try:  # the server checksums the slots: the engine's writes must be done
            await _wait(self.fence(), strict=True)
        except Exception:
            await self.abort()  # never publish bytes not known to be complete
            raise
        self.done = True
        if self.unpublished():
            named, digests = self.commit_args(())
            await self._client.commit(self._lease(), *named, via=self._conn, digests=digests)

    async def abort(self) -> None:
        """Discard the chunks not published yet (see
        :meth:`kvstrata.clients.sync.WriteBatch.abort`)."""
        if not self.done:
            await _wait(self.fence())  # a queued write must not land in a slot's next tenant
            self.done = True
            if self.unpublished():
                try:
                    await self._client.abort(self._lease(), via=self._conn)
                except LeaseError:
                    pass  # expired (its slots are freed now), or ended with its connection
