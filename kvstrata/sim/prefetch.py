"""Prefetch as the server's scheduler runs it (``kvstrata.store.prefetch``), in simulated time.

A request (``KV.PREFETCH``, of a session, ``KV.MATCH … PREFETCH``) is the chunks the server
would queue (``prefetch_todo``). :class:`PrefetchModel` keeps the scheduler's queue and moves the
chunks when its workers would:

- **workers**: ``prefetch-concurrency`` channels; a chunk starts when a worker is free (oldest
  request first, root first), and takes the source tier's latency plus its size at the tier's
  bandwidth; with ``prefetch-bandwidth`` > 0 the workers share one byte budget per second, as
  the server's pacing does. The chunk's placement (room made in the target, the promotion) is
  done when it starts, as ``fetch_one`` allocates its slot then; it is *ready* when it ends;
- **bounded queue**: at most ``prefetch-queue`` requests wait (not all their chunks started); a
  request arriving at a full queue is ``dropped``;
- **de-duplication**: a request equal to one still queued and not started (same namespace,
  chunks and target) is ``deduped``; a chunk another worker is moving is skipped, and a chunk
  already in the target when its turn comes costs nothing;
- **sessions**: a newer request for the same session ``cancelled`` the older one: its chunks not
  started yet are not moved;
- **deadlines**: a request not complete by its deadline counts ``late`` (the server's name);
  its chunks not started by then are abandoned (the turn loads them itself).

A read of a prefetched chunk (``Simulator._arrived``) counts it ``timely`` (ready by then) or
``used_late`` (still moving: the read waits for it, or, a lease, finds it below the target); a
read of a chunk still queued reads it from where it is. Events up to a command's time are run
before the command (:meth:`advance`); :meth:`drain` runs the rest (a trace's end, as the server
finishes its queue before ``KV.STATS``).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstrata.chunks import ChunkKey

if TYPE_CHECKING:
    from kvstrata.sim.engine import Simulator
    from kvstrata.sim.vtiers import VTier
    from kvstrata.store.index import ChunkRecord

COUNTERS = (
    "requests", "done", "late", "cancelled", "dropped", "deduped", "chunks", "bytes",
    "skipped", "abandoned", "timely", "used_late",
)  # fmt: skip


@dataclass(eq=False, slots=True)
class SimRequest:
    ns: str
    hashes: tuple[bytes, ...]
    target: str
    deadline: float | None
    session: bytes | None
    submitted: float = 0.0  # no chunk of it starts before
    next: int = 0  # the next chunk to start
    started: bool = False
    end: float = 0.0  # when its last started chunk is ready
    state: str = "queued"  # queued | started | done | late | cancelled

    @property
    def finished(self) -> bool:
        return self.state in ("done", "late", "cancelled")


@dataclass(slots=True)
class PrefetchModel:
    """See the module docstring."""

    sim: Simulator
    concurrency: int = 4
    queue_limit: int = 1024
    bandwidth: float = 0.0  # bytes/s shared by the workers; 0: no cap
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    #: chunks moving or moved: key → (ready time, the tier it came from)
    ready: dict[ChunkKey, tuple[float, str]] = field(default_factory=dict)
    _workers: list[float] = field(default_factory=list)  # a heap of times workers are free
    _queue: deque[SimRequest] = field(default_factory=deque)
    _same: dict[tuple[str, str, tuple[bytes, ...]], SimRequest] = field(default_factory=dict)
    _sessions: dict[tuple[str, bytes], SimRequest] = field(default_factory=dict)
    _slot: float = 0.0  # the pacing clock (prefetch-bandwidth)
    #: the trace records when the server's workers started each chunk (``fetch``)
    recorded: bool = False

    def __post_init__(self) -> None:
        self._workers = [0.0] * max(1, self.concurrency)

    # -- requests ------------------------------------------------------------------------------

    def submit(
        self,
        ns: str,
        todo: Sequence[bytes],
        target: str,
        deadline_ms: int = 0,
        session: bytes | None = None,
    ) -> SimRequest | None:
        """Queue a request at the simulator's time; None when dropped (queue full)."""
        now = self.sim.now
        self._expire(now)
        hashes = tuple(todo)
        same = self._same.get((ns, target, hashes))
        if same is not None and same.state == "queued":
            self.counts["deduped"] += 1
            return same
        if session is not None:
            older = self._sessions.get((ns, session))
            if older is not None and older.state in ("queued", "started"):
                self._unqueue(older)
                self._finish(older, "cancelled")
        if len(self._queue) >= self.queue_limit:
            self.counts["dropped"] += 1
            return None
        deadline = now + deadline_ms / 1000 if deadline_ms > 0 else None
        req = SimRequest(ns, hashes, target, deadline, session, now)
        self.counts["requests"] += 1
        self._queue.append(req)
        self._same[(ns, target, hashes)] = req
        if session is not None:
            self._sessions[(ns, session)] = req
        return req

    def queued(self) -> int:
        return len(self._queue)

    # -- the workers -----------------------------------------------------------------------------

    def advance(self, t: float) -> None:
        """Start every chunk a worker would start by time ``t`` (none when the trace says when
        the server's workers started each: :attr:`recorded`)."""
        if self.recorded:
            self._expire(t)
            return
        while self._queue:
            free = self._workers[0]
            start = max(free, self._queue[0].submitted, self._slot if self.bandwidth > 0 else 0)
            if start > t:
                return
            # paced: one chunk at a time (each waits for the budget the previous one used)
            width = 1 if self.bandwidth > 0 else sum(1 for w in self._workers if w <= start)
            batch = self._take(start, width)
            if batch is None:
                continue  # a request ended (late, done): look again
            self._start(batch, start)

    def drain(self) -> None:
        """Run the queue to its end (the server finishes it before its counters are read)."""
        if self.recorded:
            for req in list(self._queue):
                self._unqueue(req)
                self._complete(req)
            return
        self.advance(float("inf"))

    def fetched(self, ns: str, h: bytes, target: str) -> bool:
        """A recorded ``fetch``: a server's worker starts moving the chunk into ``target`` now
        (room made, then the promotion, as ``fetch_one``); the moves follow the trace, not this
        model's workers, whose timing only says when the chunk is ready."""
        sim = self.sim
        tier = sim.by_name.get(target)
        key = ChunkKey(ns, h)
        rec = sim.index.get(key)
        if tier is None or rec is None or not rec.tiers or tier.name in rec.tiers:
            self.counts["skipped"] += 1
            return False
        src = next((t for t in sim.tiers if t.name in rec.tiers and t is not tier), None)
        if src is None or sim._ensure(rec, tier) is None:
            self.counts["skipped"] += 1
            return False
        self._moved(rec, src, max(heapq.heappop(self._workers), sim.now))
        sim.enforce()
        return True

    def _moved(self, rec: ChunkRecord, src: VTier, begin: float) -> float:
        """A chunk a worker moves from ``begin`` (its placement done): its LRU stamp, the
        worker busy until it is ready, the counters; when it is ready."""
        sim = self.sim
        sim.stamp += 1e-6  # landed one after the other: distinct LRU stamps
        rec.last_access = sim.stamp
        end = begin + self._duration(src, rec.size, begin)
        heapq.heappush(self._workers, end)
        self.ready[rec.key] = (end, src.name)
        self.counts["chunks"] += 1
        self.counts["bytes"] += rec.size
        return end

    def _take(self, start: float, width: int) -> tuple[SimRequest, list[ChunkRecord]] | None:
        """Up to ``width`` chunks of the oldest request that start together at ``start``."""
        req = self._queue[0]
        if req.deadline is not None and req.deadline <= start:
            self.counts["abandoned"] += len(req.hashes) - req.next
            self._unqueue(req)
            self._finish(req, "late")
            return None
        get = self.sim.index.get
        out: list[ChunkRecord] = []
        while req.next < len(req.hashes) and len(out) < width:
            key = ChunkKey(req.ns, req.hashes[req.next])
            req.next += 1
            req.started = True
            req.state = "started"
            rec = get(key)
            moving = self.ready.get(key)
            if rec is None or not rec.tiers or (moving is not None and moving[0] > start):
                self.counts["skipped"] += 1  # gone, or another worker is moving it
                continue
            out.append(rec)
        if req.next >= len(req.hashes):
            self._unqueue(req)
            if not out:
                self._complete(req)
        return (req, out) if out else None

    def _start(self, batch: tuple[SimRequest, list[ChunkRecord]], start: float) -> None:
        req, records = batch
        sim = self.sim
        target = sim.by_name[req.target]
        # where each comes from (None: already in the target, e.g. a read promoted it)
        srcs = [
            None
            if target.name in rec.tiers
            else next((t for t in sim.tiers if t.name in rec.tiers and t is not target), None)
            for rec in records
        ]
        sim._room_for_group(records, target)  # the room maker serves waiters together
        for rec, src in zip(records, srcs, strict=True):
            worker = heapq.heappop(self._workers)
            begin = max(worker, start)
            if src is None or not (target.name in rec.tiers or sim._ensure(rec, target)):
                self.counts["skipped"] += 1  # already there (a read promoted it), or no room
                heapq.heappush(self._workers, begin)
                continue
            req.end = max(req.end, self._moved(rec, src, begin))
        if req.next >= len(req.hashes) and not req.finished:
            self._complete(req)
        sim.enforce()

    def _duration(self, src: VTier, size: int, begin: float) -> float:
        if self.bandwidth > 0:
            self._slot = max(self._slot, begin) + size / self.bandwidth
        return src.spec.latency + size / src.spec.bandwidth

    def _complete(self, req: SimRequest) -> None:
        if req.finished:
            return
        late = req.deadline is not None and req.end > req.deadline
        self._finish(req, "late" if late else "done")

    # -- reads -----------------------------------------------------------------------------------

    def arrived(self, rec: ChunkRecord, now: float) -> None:
        """A prefetched chunk is read: was it there in time?"""
        got = self.ready.pop(rec.key, None)
        if got is not None:
            self.counts["timely" if got[0] <= now else "used_late"] += 1

    def moving_from(self, rec: ChunkRecord, now: float) -> str | None:
        """The tier a chunk still moving comes from (a lease finds it there), else None."""
        got = self.ready.get(rec.key)
        return got[1] if got is not None and got[0] > now else None

    # -- bookkeeping -----------------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        for req in [r for r in self._queue if r.deadline is not None and r.deadline <= now]:
            self.counts["abandoned"] += len(req.hashes) - req.next
            self._unqueue(req)
            self._finish(req, "late")

    def _unqueue(self, req: SimRequest) -> None:
        try:
            self._queue.remove(req)
        except ValueError:
            pass
        key = (req.ns, req.target, req.hashes)
        if self._same.get(key) is req:
            del self._same[key]

    def _finish(self, req: SimRequest, state: str) -> None:
        if req.finished:
            return
        req.state = state
        self.counts[state] += 1
        if req.session is not None and self._sessions.get((req.ns, req.session)) is req:
            del self._sessions[(req.ns, req.session)]
