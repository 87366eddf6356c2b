"""Background prefetch: promote chains toward a fast tier before the next turn needs them.

A request (``KV.PREFETCH``, ``KV.MATCH … PREFETCH``) names a namespace, the hashes of a chain
in order, a target tier and an optional deadline; :meth:`PrefetchScheduler.submit` queues it
and returns at once. Workers (``prefetch-concurrency`` of them) then move its chunks one by one
through the store's ``fetch`` callback, root first (the order a MATCH/LEASE needs them in).

- **Bounded queue**: at most ``prefetch-queue`` requests wait; a request arriving at a full
  queue is dropped (counted ``dropped``), never blocks the caller.
- **De-duplication**: a request equal to a queued one (same namespace, hashes and target)
  returns the queued one; a chunk that another worker is moving is skipped; a newer request for
  the same session replaces (cancels) the queued older one.
- **Cancellation**: :meth:`cancel` takes a request out of the queue at once (its slot is free);
  chunks already being moved finish, the rest are not started.
- **Bandwidth**: with ``prefetch-bandwidth`` > 0 (bytes/s, read at every chunk so CONFIG SET
  applies at once) the workers share one virtual clock: a chunk of n bytes starts no earlier
  than n / rate seconds after the previous one's slot.
- **Deadlines**: a request not complete by its deadline is counted ``late`` and its chunks not
  yet started are abandoned (the turn it was meant for is loading them itself by then).

Counters (INFO prefetch): queued and running are gauges (requests waiting, chunks being
moved); requests, done, late, cancelled, dropped, deduped, chunks, bytes, errors are totals.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from kvstrata.chunks import ChunkKey

PACE_STEP = 0.05  # seconds a paced worker sleeps before looking at the rate and request again

log = logging.getLogger("kvstrata.store.prefetch")

#: moves one chunk to the target tier; returns the bytes moved (0: already there or missing)
FetchFn = Callable[[ChunkKey, str], Awaitable[int]]
SizeFn = Callable[[ChunkKey], int]

MAX_REQUEST_CHUNKS = 65_536


@dataclass(eq=False, slots=True)
class PrefetchRequest:
    id: int
    namespace: str
    hashes: tuple[bytes, ...]
    target: str
    deadline: float | None  # monotonic seconds
    session: bytes | None = None
    next: int = 0  # index of the next chunk to start
    running: int = 0
    moved: int = 0  # bytes
    state: str = "queued"  # queued | started | done | late | cancelled

    @property
    def finished(self) -> bool:
        return self.state in ("done", "late", "cancelled")


class PrefetchScheduler:
    """See the module docstring."""

    def __init__(
        self,
        fetch: FetchFn,
        queue_limit: int,
        concurrency: int,
        bandwidth: Callable[[], int],
        size_of: SizeFn | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fetch = fetch
        self.queue_limit = queue_limit
        self.concurrency = concurrency
        self.bandwidth = bandwidth
        self.size_of = size_of or (lambda key: 0)
        self.clock = clock
        self._queue: deque[PrefetchRequest] = deque()
        self._active: dict[int, PrefetchRequest] = {}
        self._same: dict[tuple[str, str, tuple[bytes, ...]], PrefetchRequest] = {}
        self._sessions: dict[tuple[str, bytes], PrefetchRequest] = {}
        self._inflight: set[ChunkKey] = set()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._next_slot = 0.0
        self._rate_seen = 0
        self._ids = 0
        self.running = 0
        self.counts = dict.fromkeys(
            ("requests", "done", "late", "cancelled", "dropped", "deduped", "chunks", "bytes",
             "errors"), 0,
        )  # fmt: skip

    # -- requests --------------------------------------------------------------------------------

    def submit(
        self,
        ns: str,
        hashes: Sequence[bytes],
        target: str,
        deadline_ms: int | None = None,
        session: bytes | None = None,
    ) -> PrefetchRequest | None:
        """Queue a request (returns at once); None when the queue is full (dropped)."""
        self.expire()
        hashes = tuple(hashes[:MAX_REQUEST_CHUNKS])
        same = self._same.get((ns, target, hashes))
        if same is not None and same.state == "queued":
            self.counts["deduped"] += 1
            return same
        if session is not None:
            older = self._sessions.get((ns, session))
            if older is not None and older.state in ("queued", "started"):
                self.cancel(older.id)
        if len(self._queue) >= self.queue_limit:
            self.counts["dropped"] += 1
            return None
        self._ids += 1
        deadline = None if deadline_ms is None else self.clock() + deadline_ms / 1000.0
        req = PrefetchRequest(self._ids, ns, hashes, target, deadline, session)
        self.counts["requests"] += 1
        self._queue.append(req)
        self._active[req.id] = req
        self._same[(ns, target, hashes)] = req
        if session is not None:
            self._sessions[(ns, session)] = req
        self._idle.clear()
        self._wake.set()
        return req

    def get(self, request_id: int) -> PrefetchRequest | None:
        return self._active.get(request_id)

    def cancel(self, request_id: int) -> bool:
        """Take a queued or started request out of the queue; True when it was active."""
        req = self._active.get(request_id)
        if req is None or req.finished:
            return False
        self._unqueue(req)
        self._finish(req, "cancelled")
        return True

    def cancel_session(self, ns: str, session: bytes) -> bool:
        req = self._sessions.get((ns, session))
        return req is not None and self.cancel(req.id)

    def expire(self) -> int:
        """Count queued requests past their deadline as late (and abandon them)."""
        now = self.clock()
        late = [r for r in self._queue if r.deadline is not None and r.deadline <= now]
        for req in late:
            self._unqueue(req)
            self._finish(req, "late")
        return len(late)

    async def idle(self) -> None:
        """Wait until nothing is queued or running (tests, benchmarks, shutdown)."""
        while self._queue or self.running:
            self._idle.clear()
            await self._idle.wait()

    # -- workers ---------------------------------------------------------------------------------

    async def run(self) -> None:
        """Run the workers until cancelled."""
        workers = [asyncio.ensure_future(self._worker()) for _ in range(self.concurrency)]
        try:
            await asyncio.gather(*workers)
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    async def _worker(self) -> None:
        while True:
            item = self._take()
            if item is None:
                if not self._queue and not self.running:
                    self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            req, key = item
            self._inflight.add(key)
            req.running += 1
            self.running += 1
            try:
                known = self.size_of(key)
                moved = await self.fetch(key, req.target) if await self._pace(known, req) else 0
                if moved > known:
                    self._charge(moved - known)  # a chunk the index did not know (from S3)
            except Exception:
                moved = 0
                self.counts["errors"] += 1
                log.exception("prefetch of %s failed", key.hex[:16])
            finally:
                self._inflight.discard(key)
                req.running -= 1
                self.running -= 1
            if moved:
                req.moved += moved
                self.counts["chunks"] += 1
                self.counts["bytes"] += moved
            if req.running == 0 and req.next >= len(req.hashes) and not req.finished:
                late = req.deadline is not None and self.clock() > req.deadline
                self._finish(req, "late" if late else "done")
            if not self._queue and not self.running:
                self._idle.set()

    def _take(self) -> tuple[PrefetchRequest, ChunkKey] | None:
        """The next chunk to move: from the oldest queued request, skipping chunks in flight."""
        now = self.clock()
        while self._queue:
            req = self._queue[0]
            if req.deadline is not None and req.deadline <= now:
                self._unqueue(req)
                self._finish(req, "late")
                continue
            while req.next < len(req.hashes):
                key = ChunkKey(req.namespace, req.hashes[req.next])
                req.next += 1
                req.state = "started"
                if key not in self._inflight:
                    if req.next >= len(req.hashes):
                        self._unqueue(req)
                    return req, key
            self._unqueue(req)
            if req.running == 0 and not req.finished:
                self._finish(req, "done")
        return None

    async def _pace(self, nbytes: int, req: PrefetchRequest) -> bool:
        """Wait for the bandwidth budget of ``nbytes``; False when the request was cancelled
        or passed its deadline meanwhile (the chunk is then not moved). The rate is read again
        every step, so ``CONFIG SET prefetch-bandwidth`` applies to waiting workers too."""
        while True:
            if req.finished or (req.deadline is not None and req.deadline <= self.clock()):
                return False
            rate = self.bandwidth()
            if rate != self._rate_seen:  # a new rate: forget what was owed at the old one
                self._rate_seen = rate
                self._next_slot = min(self._next_slot, self.clock())
            if rate <= 0 or nbytes <= 0:
                return True
            wait = self._next_slot - self.clock()
            if wait <= 0:
                self._charge(nbytes)
                return True
            await asyncio.sleep(min(wait, PACE_STEP))

    def _charge(self, nbytes: int) -> None:
        rate = self.bandwidth()
        if rate > 0 and nbytes > 0:
            self._next_slot = max(self._next_slot, self.clock()) + nbytes / rate

    # -- bookkeeping -----------------------------------------------------------------------------

    def _unqueue(self, req: PrefetchRequest) -> None:
        try:
            self._queue.remove(req)
        except ValueError:
            pass
        key = (req.namespace, req.target, req.hashes)
        if self._same.get(key) is req:
            del self._same[key]

    def _finish(self, req: PrefetchRequest, state: str) -> None:
        req.state = state
        self.counts[state] += 1
        self._active.pop(req.id, None)
        if req.session is not None and self._sessions.get((req.namespace, req.session)) is req:
            del self._sessions[(req.namespace, req.session)]
        if not self._queue and not self.running:
            self._idle.set()

    def info(self) -> list[tuple[str, object]]:
        self.expire()
        c = self.counts
        return [
            ("prefetch_queued", len(self._queue)),
            ("prefetch_running", self.running),
            ("prefetch_requests", c["requests"]),
            ("prefetch_done", c["done"]),
            ("prefetch_late", c["late"]),
            ("prefetch_cancelled", c["cancelled"]),
            ("prefetch_dropped", c["dropped"]),
            ("prefetch_deduped", c["deduped"]),
            ("prefetch_chunks", c["chunks"]),
            ("prefetch_bytes", c["bytes"]),
            ("prefetch_errors", c["errors"]),
            ("prefetch_queue_limit", self.queue_limit),
            ("prefetch_concurrency", self.concurrency),
            ("prefetch_bandwidth", self.bandwidth()),
        ]
