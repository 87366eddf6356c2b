"""``put_chain``'s streamed path (issue 31): the server works while the client copies.

A batched put is ``KV.MRESERVE``, one copy per chunk into its slot, ``KV.COMMIT``. Done once for
the whole chain, the server's work (~45 µs of CPU per chunk to reserve and publish, on the 2-core
VM) and the client's copies take turns, and at 1 MiB chunks the server's turns cost about half
the copy time. Streamed, the chain is cut into parts of about :data:`PIPE_BYTES`, and one part
(and :data:`PIPE_CHUNKS` chunks) is reserved ahead, all on one connection:

======================  ===================================  ==============================
client                  wire (in order)                      server, meanwhile
======================  ===================================  ==============================
reserve part 0, wait    ``KV.MRESERVE`` 0
fill part 0             ``KV.MRESERVE`` 1 (sent first)       reserves part 1
commit part 0           ``KV.COMMIT`` 0, ``KV.MRESERVE`` 2
fill part 1                                                  publishes 0, reserves 2
read the two replies    ``KV.COMMIT`` 1, ``KV.MRESERVE`` 3
fill part 2 …                                                publishes 1, reserves 3
======================  ===================================  ==============================

so only the first reservation and the last commit are waited for, and each part costs one write
(each write to a server waiting in ``epoll`` is a wake-up, tens of µs on a VM). What a chunk
costs and means is unchanged: each part is a batch of its own (its chunks published by one
``KV.COMMIT`` with their digests, after they were filled whole), published in chain order, and
a commit's reply is read before the next part's commit is sent, so a part whose commit failed
is never followed by a published part. Failures: a refused or unusable reservation
(``-LEASELIMIT``, ``-OOM``, an arena this host cannot map, found by the first write into a
slot) ends the stream once what is in flight is read, and that part and the rest are put the
ordinary way, one batch at a time (which halves on ``-LEASELIMIT``, goes over the socket when
the arena cannot be mapped and raises the rest); a failed commit, or any other exception while
filling, aborts the filled part and the reservation sent ahead before it is raised (parts
committed before it stay stored, as with any chain put). A lost connection raises; the server
ends its leases with it.

Sans I/O: :func:`stream_chain` is a generator of :class:`Send`, :data:`READ` and
:class:`MakeBatch` steps that the sync and asyncio clients drive on their own connections.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

from kvstrata.clients import commands as cmd
from kvstrata.clients.handles import RegionMapError
from kvstrata.clients.leases import WriteBatchBase, batch_slices, put_states
from kvstrata.clients.results import BatchGrant
from kvstrata.protocol.errors import RespError

__all__ = [
    "PIPE_BYTES",
    "PIPE_CHUNKS",
    "READ",
    "MakeBatch",
    "Send",
    "StreamOpts",
    "pipe_slices",
    "stream_chain",
]

#: a part of a streamed chain holds at least this many bytes and :data:`PIPE_CHUNKS` chunks:
#: the first reservation and the last commit, the only server work waited for, cover one part;
#: each part costs a write that wakes the server and a reply that the client reads (on the 2-core
#: VM ~0.1–0.2 ms of CPU in all), and must take longer to fill than the server takes to reserve
#: the next one and publish the one before (a 1 MiB chunk: ~0.1 ms to copy, ~45 µs to serve).
#: 64 × 1 MiB measured 0.67 / 0.75–0.82 / 0.79–0.83 / 0.78–0.81× memcpy with parts of 4 / 8 /
#: 16 / 32 chunks, 0.72–0.76× as one batch. A chain of one part is not streamed: where chunks
#: are large the server's share is small (8 MiB: ~45 µs of ~0.8 ms) and one batch wins.
PIPE_BYTES = 8 * 1024 * 1024
PIPE_CHUNKS = 16


def pipe_slices(
    sizes: Sequence[int], min_bytes: int | None = None, min_chunks: int | None = None
) -> list[slice]:
    """A chain cut into consecutive parts of at least ``min_bytes`` (:data:`PIPE_BYTES`) and
    ``min_chunks`` (:data:`PIPE_CHUNKS`), the last part what is left; never more than a batch
    (``leases.batch_slices``) holds."""
    return batch_slices(
        sizes,
        min_chunks=PIPE_CHUNKS if min_chunks is None else min_chunks,
        min_bytes=PIPE_BYTES if min_bytes is None else min_bytes,
    )


@dataclass(slots=True)
class Send:
    """Write these commands on the stream's connection (replies read later, in order)."""

    commands: list[tuple[Any, ...]]


class _Read:
    __slots__ = ()

    def __repr__(self) -> str:
        return "READ"


#: read the next reply of the stream's connection (an error reply is returned, not raised)
READ = _Read()


@dataclass(slots=True)
class MakeBatch:
    """The write batch of ``grant`` for ``hashes`` (the client maps its regions); an exception
    raised building it is thrown back into the generator."""

    hashes: Sequence[Any]
    grant: BatchGrant


@dataclass(slots=True)
class StreamOpts:
    """``digests``: send ``KV.COMMIT … DIGEST`` (set False when the server refuses it)."""

    digests: bool = True


Step = Send | _Read | MakeBatch


def stream_chain(
    ns: str,
    hashes: Sequence[Any],
    srcs: Sequence[Any],
    sizes: Sequence[int],
    parts: Sequence[slice],
    parent: Any,
    tokens: int,
    opts: StreamOpts,
) -> Generator[Step, Any, tuple[list[str], int]]:
    """Put the chain's ``parts`` streamed (see the module docstring). Returns the per-chunk
    states of the parts done and how many parts that is: the caller puts the rest (a refused
    reservation) the ordinary way."""
    states: list[str] = []

    def reserve(k: int) -> cmd.Call[BatchGrant]:
        part = parts[k]
        link = parent if part.start == 0 else hashes[part.start - 1]
        return cmd.mreserve(ns, link, hashes[part], sizes[part], tokens, tier="dram")

    def commit_args(batch: WriteBatchBase, with_digests: bool) -> tuple[Any, ...]:
        named, digests = batch.commit_args(())
        return cmd.commit(batch._lease(), *named, digests=digests if with_digests else ()).args

    def aborted(*leases: Any) -> Generator[Step, Any, None]:
        """Abort the leases (not None) of batches never committed; their replies are read
        (an error there changes nothing: the caller raises what made it abort)."""
        sent = [lease for lease in leases if lease is not None]
        if sent:
            yield Send([cmd.abort(lease).args for lease in sent])
            for _ in sent:
                yield READ

    def dropped(batch: WriteBatchBase, late: Any) -> Generator[Step, Any, None]:
        """Abort the part being filled (unless nothing was reserved for it) and the
        reservation ``late`` answered (the part sent ahead)."""
        yield from aborted(None if batch.done else batch.lease_id, lease_of(late))
        batch.done = True

    def lease_of(reply: Any) -> Any:
        """The lease of a reservation reply read only to abort it (None: nothing reserved)."""
        if isinstance(reply, RespError) or type(reply) is not list or not reply:
            return None
        return reply[0]

    def committed(batch: WriteBatchBase, reply: Any) -> Generator[Step, Any, RespError | None]:
        """Check a commit's reply (read with nothing else in flight): a server refusing DIGEST
        gets the commit again without; the error of a failed commit is returned."""
        if not isinstance(reply, RespError):
            return None
        if not (opts.digests and cmd.refuses_digests(reply)):
            return reply
        opts.digests = False  # an older server: it hashes the slots itself
        yield Send([commit_args(batch, False)])
        again = yield READ
        return again if isinstance(again, RespError) else None

    def drain(committing: WriteBatchBase | None) -> Generator[Step, Any, None]:
        """Read the reply of the commit in flight, if any (nothing after it); raise a failure."""
        if committing is not None:
            failed = yield from committed(committing, (yield READ))
            if failed is not None:
                raise failed

    first = reserve(0)
    yield Send([first.args])
    reply = yield READ
    if isinstance(reply, RespError):
        return states, 0  # the ordinary way reserves it again (halving, or raising)
    try:
        batch: WriteBatchBase = yield MakeBatch(hashes[parts[0]], first.result(reply))
    except Exception:
        yield from aborted(lease_of(reply))
        return states, 0
    committing: WriteBatchBase | None = None  # its KV.COMMIT sent, its reply not read yet
    ahead = reserve(1) if len(parts) > 1 else None  # the next part's reservation in flight
    if ahead is not None:
        yield Send([ahead.args])  # reserved by the server while part 0 is filled
    done_parts = 0
    for k, part in enumerate(parts):
        try:
            for i in batch.reserved:
                batch.write(i, srcs[part.start + i])
        except BaseException as exc:
            prev = (yield READ) if committing is not None else None
            late = (yield READ) if ahead is not None else None
            yield from dropped(batch, late)
            if not isinstance(exc, RegionMapError):
                raise  # (the previous part's commit, stored or not: this is what failed)
            # the arena cannot be mapped from here (its first slot is mapped by the first
            # write): this part and the rest the ordinary way, which goes over the socket
            if committing is not None:
                failed = yield from committed(committing, prev)
                if failed is not None:
                    raise failed from exc
            return states, k
        # the replies in flight, in the order sent: the previous part's commit, then ``ahead``
        done = (yield READ) if committing is not None else None
        reply = (yield READ) if ahead is not None else None
        if committing is not None:
            failed = yield from committed(committing, done)
            if failed is not None:  # nothing after a part that is not stored
                yield from dropped(batch, reply)
                raise failed
        nxt: WriteBatchBase | None = None
        if ahead is not None and not isinstance(reply, RespError):
            try:
                nxt = yield MakeBatch(hashes[parts[k + 1]], ahead.result(reply))
            except Exception:  # e.g. an arena this host cannot map: aborted, done again below
                yield from aborted(lease_of(reply))
        # this part's commit and the reservation of the part after the next, in one write:
        # the server runs both while the client fills the next part
        ahead = reserve(k + 2) if nxt is not None and k + 2 < len(parts) else None
        sends = [] if ahead is None else [ahead.args]
        committing = None
        if not batch.done:  # (done: nothing was reserved, every chunk is stored or busy)
            sends.insert(0, commit_args(batch, opts.digests))
            batch.done = True
            committing = batch
        if sends:
            yield Send(sends)
        states += put_states(batch.states)
        done_parts = k + 1
        if nxt is None:  # the last part, or the next one's reservation refused or unusable
            break
        batch = nxt
    yield from drain(committing)
    return states, done_parts
