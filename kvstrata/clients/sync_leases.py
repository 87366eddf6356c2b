"""The blocking client's lease objects: a read :class:`Lease`, a reserved slot
(:class:`WriteLease`) and the slots of a chain (:class:`WriteBatch`), each ended on the
connection that took it by its :class:`~kvstrata.clients.sync.Client`, after the engine's
queued copies (its fence). Their shared state and checks are in :mod:`kvstrata.clients.leases`.
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from kvstrata.clients.connection import SyncConnection
from kvstrata.clients.leases import Fence, LeaseBase, WriteBatchBase, WriteLeaseBase, run_fence
from kvstrata.protocol.errors import LeaseError

if TYPE_CHECKING:
    from kvstrata.clients.sync import Client

__all__ = ["Lease", "WriteBatch", "WriteLease"]


def _wait(fence: Fence | None, strict: bool = False) -> None:
    if fence is not None:
        run_fence(fence, strict)


class Lease(LeaseBase):
    """A read lease (see :class:`~kvstrata.clients.leases.LeaseBase`); ``with`` releases it.
    ``conn``: the connection that took it (its release goes there)."""

    __slots__ = ("_client", "_conn")

    def __init__(self, client: Client, *args: Any, conn: SyncConnection | None = None) -> None:
        super().__init__(*args)
        self._client = client
        self._conn = conn

    def release(self) -> None:
        if not self.done:
            _wait(self.fence())  # the engine's queued copies out of the slots come first
            self.done = True
            self._client.release(self.lease_id, via=self._conn)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class _CommitOnExit:
    """``with``: commit on success (unless done already), abort on an exception."""

    __slots__ = ()
    done: bool

    if TYPE_CHECKING:

        def commit(self) -> None: ...
        def abort(self) -> None: ...

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if et is None:
            if not self.done:
                self.commit()
        else:
            self.abort()


class WriteLease(_CommitOnExit, WriteLeaseBase):
    """A reserved slot; ``with`` commits it on success and aborts it on an exception.
    ``conn``: the connection that took it (its commit or abort goes there)."""

    __slots__ = ("_client", "_conn")

    def __init__(self, client: Client, *args: Any, conn: SyncConnection | None = None) -> None:
        super().__init__(*args)
        self._client = client
        self._conn = conn

    def commit(self) -> None:
        if self.done:
            raise RuntimeError("this write lease is already committed or aborted")
        try:  # the server checksums the slot: the engine's writes must be done
            _wait(self.fence(), strict=True)
        except Exception:
            self.abort()  # never publish bytes not known to be complete
            raise
        self.done = True
        self._client.commit(self.lease_id, via=self._conn, digests=self.commit_digests())

    def abort(self) -> None:
        if not self.done:
            _wait(self.fence())  # a queued write must not land in the slot's next tenant
            self.done = True
            self._client.abort(self.lease_id, via=self._conn)


class WriteBatch(_CommitOnExit, WriteBatchBase):
    """Reserved slots of a chain (see :class:`~kvstrata.clients.leases.WriteBatchBase`);
    ``with`` commits them all on success and aborts them all on an exception. ``conn``: the
    connection that took the lease (its publish, commit or abort goes there)."""

    __slots__ = ("_client", "_conn")

    def __init__(self, client: Client, *args: Any, conn: SyncConnection | None = None) -> None:
        super().__init__(*args)
        self._client = client
        self._conn = conn

    def publish(self, *indexes: int) -> None:
        """Publish chunks now (``KV.COMMIT lease i…``) and wait for the reply; call it once
        their slots are completely written. A refusal raises: ``LeaseError`` when the lease
        expired (nothing of this call was published; stop using every view of the batch,
        then abort it), or the error naming the chunk that could not be published. Either way
        the chunks named count as published: the batch does not send them again."""
        if self.done:
            raise RuntimeError("this write batch is already committed or aborted")
        self._check_unpublished(indexes)
        _wait(self.fence(), strict=True)  # queued GPU writes into the slots come first
        named, digests = self.commit_args(indexes)
        self.published.append(indexes)
        self._client.commit(self._lease(), *named, via=self._conn, digests=digests)

    def commit(self) -> None:
        """Publish every chunk not published yet (one ``KV.COMMIT``); a failure raises and
        aborts what is left."""
        if self.done:
            raise RuntimeError("this write batch is already committed or aborted")
        try:  # the server checksums the slots: the engine's writes must be done
            _wait(self.fence(), strict=True)
        except Exception:
            self.abort()  # never publish bytes not known to be complete
            raise
        self.done = True
        if self.unpublished():
            named, digests = self.commit_args(())
            self._client.commit(self._lease(), *named, via=self._conn, digests=digests)

    def abort(self) -> None:
        """Discard the chunks not published yet (those published stay stored). Of an expired
        lease this ends what the server still holds for it (``-NOLEASE`` is not raised: the
        slots are freed either way)."""
        if not self.done:
            _wait(self.fence())  # a queued write must not land in a slot's next tenant
            self.done = True
            if self.unpublished():
                try:
                    self._client.abort(self._lease(), via=self._conn)
                except LeaseError:
                    pass  # expired (its slots are freed now), or ended with its connection
