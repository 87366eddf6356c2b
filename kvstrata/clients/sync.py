"""The blocking kvstrata client: typed ``KV.*`` methods over a thread-safe connection pool.

    from kvstrata.clients import Client, chunk_hashes

    with Client(port=7379) as kv:
        hashes = chunk_hashes(token_ids, "llama-3.1-8b@bf16@tp1r0@c256", 256)
        n = kv.match("llama-3.1-8b@bf16@tp1r0@c256", hashes)
        kv.get(ns, hashes[0], out=tensor)          # received straight into the tensor

Every method borrows a connection from the pool for one round trip, so one ``Client`` may be
shared by threads. A lease belongs to the connection that took it (the server refuses its
id from any other): a lease object ends it on that connection, waiting for it to be free;
:meth:`Client.commit`/``abort``/``release`` by id take it as ``via``. Error replies raise
the exception classes of :mod:`kvstrata.protocol.errors` (``LeaseError`` for ``-NOLEASE``,
``OutOfMemoryError`` for ``-OOM`` …).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

from kvstrata.clients import commands as cmd
from kvstrata.clients.chain_stream import (
    READ,
    MakeBatch,
    Send,
    StreamOpts,
    pipe_slices,
    stream_chain,
)
from kvstrata.clients.commands import Call, HashLike
from kvstrata.clients.connection import (
    ConnectionPool,
    ConnectionSettings,
    SyncConnection,
    loading_delays,
    settings_from_url,
)
from kvstrata.clients.handles import RegionMapError, lease_tier
from kvstrata.clients.leases import batch_slices, put_states
from kvstrata.clients.pipeline import PipelineBase
from kvstrata.clients.regions import regions_stale, update_regions
from kvstrata.clients.resp import as_bytes_view
from kvstrata.clients.results import BatchGrant, Handle, LeaseId, RegionInfo
from kvstrata.clients.sync_leases import Lease, WriteBatch, WriteLease
from kvstrata.protocol.errors import LeaseLimitError, LoadingError, RespError

__all__ = ["Client", "Lease", "Pipeline", "WriteBatch", "WriteLease", "settings_from_url"]

T = TypeVar("T")
P = ParamSpec("P")


def _command(build: Callable[P, Call[T]]) -> Callable[Concatenate[Client, P], T]:
    """A :class:`Client` method that sends the command ``build`` makes and returns its result."""

    def method(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._run(build(*args, **kwargs))

    return cmd.method_like(build, method)


def _fill(batch: WriteBatch, srcs: Sequence[Any]) -> list[str]:
    """Copy ``srcs`` into ``batch``'s slots (inside its ``with``, which commits them)."""
    for i in batch.reserved:
        batch.write(i, srcs[i])
    return put_states(batch.states)


class Pipeline(PipelineBase):
    """Commands queued on one connection and sent in one write; ``execute()`` returns results."""

    def __init__(self, client: Client) -> None:
        super().__init__()
        self._client = client

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        calls = self._take()
        if not calls:
            return []
        with self._client.pool.connection() as conn:
            replies = conn.pipeline([c.args for c in calls], [c.out for c in calls])
        return self._decode(calls, replies, raise_on_error)

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self._calls = []


class Client:
    """Blocking client; see the module docstring. Arguments as :class:`ConnectionSettings`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 7379, **kwargs: Any) -> None:
        max_connections = kwargs.pop("max_connections", 16)
        self.settings = ConnectionSettings(host=host, port=port, **kwargs)
        self.pool = ConnectionPool(self.settings, max_connections)
        self._regions: dict[str, RegionInfo] = {}
        self._digests = True  # False once the server turned KV.COMMIT … DIGEST down
        self._regions_generation = -1
        #: False once the server's arena proved unreachable from here (``put_chain`` then
        #: sends bytes over the socket)
        self.shared_memory = True
        self.pool.release(self.pool.acquire())  # connect now: fail fast on a wrong address

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> Client:
        return cls(**settings_from_url(url, **kwargs))

    def _run(self, call: Call[T], via: SyncConnection | None = None) -> T:
        return self._take(call, via)[0]

    def _take(self, call: Call[T], via: SyncConnection | None = None) -> tuple[T, SyncConnection]:
        """The result of ``call`` run on ``via`` (default: any pooled connection), and the
        connection it ran on (a lease taken is that connection's)."""
        delays = None
        while True:
            with self.pool.connection(via) as conn:
                reply = conn.pipeline([call.args], [call.out])[0]
            if type(reply) is not LoadingError:
                return call.result(reply), conn
            # the server is still building its tiers: nothing was done, send it again
            delays = delays or loading_delays(self.settings.loading_timeout)
            delay = next(delays, None)
            if delay is None:
                raise reply  # still loading after loading_timeout seconds
            time.sleep(delay)

    def execute(self, *args: Any, out: Any = None) -> Any:
        """Any command; the reply as parsed (see :mod:`kvstrata.clients.resp`)."""
        return self._run(cmd.raw(args, out))

    def pipeline(self) -> Pipeline:
        return Pipeline(self)

    ping = _command(cmd.ping)
    put = _command(cmd.put)
    get = _command(cmd.get)
    mget = _command(cmd.mget)
    match = _command(cmd.match)
    match_tiers = _command(cmd.match_tiers)
    match_tokens = _command(cmd.match_tokens)

    def regions(self, refresh: bool = True) -> list[RegionInfo]:
        if refresh or not self._regions:
            self._refresh_regions(())
        return list(self._regions.values())

    def _refresh_regions(self, handles: Sequence[Handle]) -> None:
        generation = self.pool.generation
        self._regions = update_regions(self._regions, self._run(cmd.regions()), handles)
        self._regions_generation = generation

    def _regions_for(self, handles: Sequence[Handle]) -> dict[str, RegionInfo]:
        # A handle of an instance we have not mapped (a restarted server: same region names,
        # another arena) or a new connection: ask KV.REGIONS again, unmap the regions of the
        # instance that is gone, and refuse a handle that still does not match.
        if self._regions_generation != self.pool.generation or regions_stale(
            self._regions, handles
        ):
            self._refresh_regions(handles)
        return self._regions

    def lease(
        self,
        ns: str,
        hashes: Sequence[HashLike],
        ttl_ms: int | None = None,
        tier: str | None = None,
    ) -> Lease | None:
        """Pin chunks for zero-copy reads; None when nothing was leased.

        ``tier`` ("gpu" or "dram") chooses where the handles point. By default a process
        without usable CUDA asks for ``dram`` (shared-memory handles), and one with CUDA lets
        the server choose (its GPU pool when it has one, falling back to DRAM per chunk)."""
        grant, conn = self._take(cmd.lease(ns, hashes, ttl_ms, lease_tier(tier)))
        if grant is None:
            return None
        try:
            regions = self._regions_for(grant.handles)
            keys = [bytes(cmd.hash_bytes(h)) for h in hashes]
            return Lease(self, ns, keys, grant, regions, conn=conn)
        except BaseException:
            self.release(grant.lease_id, via=conn)  # don't leave the chunks pinned until the TTL
            raise

    def reserve(
        self,
        ns: str,
        hash: HashLike,
        parent: HashLike | None,
        nbytes: int,
        tokens: int = 0,
        ttl_ms: int | None = None,
        tier: str | None = None,
    ) -> WriteLease:
        """Reserve an invisible slot to fill in place; commit publishes it."""
        grant, conn = self._take(cmd.reserve(ns, hash, parent, nbytes, tokens, ttl_ms, tier))
        try:
            regions = self._regions_for((grant.handle,))
            return WriteLease(self, ns, bytes(cmd.hash_bytes(hash)), grant, regions, conn=conn)
        except BaseException:
            self.abort(grant.lease_id, via=conn)  # free the reserved slot now, not at the TTL
            raise

    def reserve_chain(
        self,
        ns: str,
        parent: HashLike | None,
        hashes: Sequence[HashLike],
        sizes: Sequence[int],
        tokens: int = 0,
        ttl_ms: int | None = None,
        tier: str | None = None,
    ) -> WriteBatch:
        """Reserve invisible slots for the chain ``hashes`` (the first linked to ``parent``)
        in one round trip (``KV.MRESERVE``); committing publishes them all in one more. Chunks
        stored already or being written elsewhere get no slot (``states``)."""
        grant, conn = self._take(cmd.mreserve(ns, parent, hashes, sizes, tokens, ttl_ms, tier))
        return self._write_batch(ns, hashes, grant, conn)

    def _write_batch(
        self, ns: str, hashes: Sequence[HashLike], grant: BatchGrant, conn: SyncConnection
    ) -> WriteBatch:
        """The batch of a KV.MRESERVE reply; its lease is aborted when that fails."""
        try:
            return self._batch_of(ns, hashes, grant, conn)
        except BaseException:
            if grant.lease_id is not None:
                self.abort(grant.lease_id, via=conn)  # free the slots now, not at the TTL
            raise

    def put_chain(
        self,
        ns: str,
        hashes: Sequence[HashLike],
        payloads: Sequence[Any],
        parent: HashLike | None = None,
        tokens: int = 0,
    ) -> list[str]:
        """Store the chain ``hashes`` (the first linked to ``parent``), skipping chunks stored
        already. On the server's host: ``KV.MRESERVE``, one copy per chunk into its slot,
        ``KV.COMMIT``; a chain of more than one part (``chain_stream.pipe_slices``: 16 chunks
        and 8 MiB at least) is streamed, one part reserved ahead, so the server reserves and
        publishes while this client copies (:mod:`kvstrata.clients.chain_stream`). Else (or
        once the arena proved unreachable) one pipelined write of ``KV.PUT … NX`` per batch of
        at most ``BATCH_CHUNKS`` chunks / ``BATCH_BYTES``. Per chunk: ``"stored"``,
        ``"exists"`` or ``"busy"`` (another client is writing it)."""
        if len(payloads) != len(hashes):
            raise ValueError("put_chain needs one payload per hash")
        srcs = [as_bytes_view(p) for p in payloads]
        sizes = [len(b) for b in srcs]
        out: list[str] = []
        start = 0
        if self.shared_memory and self.pool.max_connections > 1:  # (regions: a 2nd connection)
            parts = pipe_slices(sizes)
            if len(parts) > 1:
                out, done = self._stream(ns, hashes, srcs, sizes, parts, parent, tokens)
                start = parts[done].start if done < len(parts) else len(hashes)
        for part in batch_slices(sizes[start:]):  # what was not streamed, the ordinary way
            part = slice(start + part.start, start + part.stop)
            link = parent if part.start == 0 else hashes[part.start - 1]
            out += self._put_batch(ns, hashes[part], srcs[part], link, tokens)
        return out

    def _stream(
        self,
        ns: str,
        hashes: Sequence[HashLike],
        srcs: Sequence[Any],
        sizes: Sequence[int],
        parts: Sequence[slice],
        parent: HashLike | None,
        tokens: int,
    ) -> tuple[list[str], int]:
        """``chain_stream.stream_chain`` driven on one connection held throughout (replies in
        flight on it belong to the stream): its states and how many parts it put."""
        opts = StreamOpts(self._digests)
        with self.pool.connection() as conn:
            steps = stream_chain(ns, hashes, srcs, sizes, parts, parent, tokens, opts)
            try:
                step = next(steps)
                while True:
                    if step is READ:
                        step = steps.send(conn.receive(1)[0])
                    elif isinstance(step, Send):
                        conn.send(step.commands)
                        step = next(steps)
                    else:
                        assert isinstance(step, MakeBatch)
                        try:
                            batch = self._batch_of(ns, step.hashes, step.grant, conn)
                        except Exception as exc:  # the stream aborts its lease
                            step = steps.throw(exc)
                        else:
                            step = steps.send(batch)
            except StopIteration as stop:
                return stop.value
            finally:
                self._digests = opts.digests

    def _batch_of(
        self, ns: str, hashes: Sequence[HashLike], grant: BatchGrant, conn: SyncConnection
    ) -> WriteBatch:
        """The batch of a KV.MRESERVE reply (its regions mapped); nothing aborted on failure."""
        regions = self._regions_for([h for h in grant.handles if h is not None])
        keys = [bytes(cmd.hash_bytes(h)) for h in hashes]
        return WriteBatch(self, ns, keys, grant, regions, conn=conn)

    def _put_batch(
        self, ns: str, hashes: Sequence[HashLike], srcs: Sequence[Any], parent: Any, tokens: int
    ) -> list[str]:
        """One batch; halved while the server refuses its reservation with -LEASELIMIT (the
        batch is over ``lease-reserve-max-per-client``, e.g. on a small arena: the server
        reserved nothing), until a single chunk is refused."""
        try:
            return self._put_batch_once(ns, hashes, srcs, parent, tokens)
        except LeaseLimitError:
            if len(hashes) < 2:
                raise
        mid = len(hashes) // 2
        first = self._put_batch(ns, hashes[:mid], srcs[:mid], parent, tokens)
        return first + self._put_batch(ns, hashes[mid:], srcs[mid:], hashes[mid - 1], tokens)

    def _put_batch_once(
        self, ns: str, hashes: Sequence[HashLike], srcs: Sequence[Any], parent: Any, tokens: int
    ) -> list[str]:
        if self.shared_memory:
            sizes = [len(b) for b in srcs]
            try:
                with self.reserve_chain(ns, parent, hashes, sizes, tokens, tier="dram") as batch:
                    return _fill(batch, srcs)
            except RegionMapError:
                self.shared_memory = False  # the server is on another host: bytes over TCP
        with self.pipeline() as p:
            for h, src in zip(hashes, srcs, strict=True):
                p.put(ns, h, parent, src, tokens=tokens, nx=True)
                parent = h
            return ["stored" if ok else "exists" for ok in p.execute()]

    def commit(
        self,
        lease_id: LeaseId,
        *indexes: int,
        via: SyncConnection | None = None,
        digests: Sequence[bytes] = (),
    ) -> None:
        """``KV.COMMIT lease [index…] [DIGEST digest…]`` on ``via``, the connection that took
        the lease (the server refuses another's: -NOLEASE; default: any pooled connection)."""
        if digests and self._digests:
            try:
                self._run(cmd.commit(lease_id, *indexes, digests=digests), via)
                return
            except RespError as exc:
                if not cmd.refuses_digests(exc):
                    raise
                self._digests = False  # an older server: it hashes the slots itself
        self._run(cmd.commit(lease_id, *indexes), via)

    def abort(self, lease_id: LeaseId, via: SyncConnection | None = None) -> None:
        """``KV.ABORT lease`` on ``via`` (see :meth:`commit`)."""
        self._run(cmd.abort(lease_id), via)

    def release(self, lease_id: LeaseId, via: SyncConnection | None = None) -> None:
        """``KV.RELEASE lease`` on ``via`` (see :meth:`commit`)."""
        self._run(cmd.release(lease_id), via)

    info = _command(cmd.info)
    delete = _command(cmd.delete)
    stats = _command(cmd.stats)

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
