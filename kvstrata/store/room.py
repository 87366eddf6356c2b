"""Writers waiting for DRAM room, served first come, first served, with a bound.

Without a queue every writer that found DRAM full evicted victims for itself and then raced the
others for the room it made: under sustained pressure some writers lost again and again (PUT,
RESERVE and LEASE waits of 5–24 s were seen). Here a writer that does not fit joins one FIFO;
a single room maker serves it in order: it reserves the slot for the head the moment it fits
(so nobody behind can take it), and otherwise moves victims out for the first few waiters at
once (their write-backs run in parallel), while the background demoter, kicked, keeps working
towards the low watermark ahead of demand.

Bounds: at most ``write-wait-queue`` writers wait (more get ``-OOM``), each at most
``write-wait-timeout`` ms (then ``-OOM``); when no victim can leave (everything pinned or
leased) the head gets None at once (the caller's usual OOM), never an endless wait. When no
victim is left only because the demoter's moves hold them (a chain's parent becomes a leaf once
its child is gone), the room maker waits for a move to end and tries again.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstrata.chunks import ChunkKey
from kvstrata.protocol.errors import OutOfMemoryError
from kvstrata.tiers.base import TierFull

if TYPE_CHECKING:
    from kvstrata.store.placement import Placement

#: waiters whose room is made in one round (their victims' write-backs overlap)
_AHEAD = 8
#: loop turns a woken ``room_for`` waiter needs to reserve its slot (future → shield → task)
_HANDOVER_STEPS = 4


@dataclass(slots=True)
class _Waiter:
    key: ChunkKey | None  # reserve a slot for it; None: only wait until the room exists
    nbytes: int
    future: asyncio.Future[memoryview | bool | None] = field(repr=False)


class RoomQueue:
    """See the module docstring."""

    def __init__(self, placement: Placement, limits: Callable[[], tuple[int, float]]) -> None:
        self.placement = placement
        self._limits = limits  # (most waiters, seconds each may wait)
        self._waiters: deque[_Waiter] = deque()
        self._worker: asyncio.Task[None] | None = None
        self.waited = 0  # writes that had to queue (INFO)
        self.timeouts = 0

    def __len__(self) -> int:
        return len(self._waiters)

    async def close(self) -> None:
        """Stop the room maker (store shutdown); waiters get None."""
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        while self._waiters:
            self._fail_head()

    async def reserve(self, key: ChunkKey, nbytes: int) -> memoryview | None:
        """A DRAM slot for ``key``, now or in turn; None when no room can be made."""
        dram = self.placement.state.dram
        assert dram is not None
        if not self._waiters:
            try:
                return dram.reserve(key, nbytes)
            except TierFull:
                pass
        got = await self._wait(key, nbytes)
        return got if isinstance(got, memoryview) else None

    async def room_for(self, nbytes: int) -> bool:
        """Wait in turn until ``nbytes`` fit in DRAM (not reserved); False when they cannot."""
        dram = self.placement.state.dram
        assert dram is not None
        if not self._waiters and self.placement.free_for(dram) >= nbytes:
            return True
        return bool(await self._wait(None, nbytes))

    async def _wait(self, key: ChunkKey | None, nbytes: int) -> memoryview | bool | None:
        most, seconds = self._limits()
        if len(self._waiters) >= most:
            raise OutOfMemoryError(
                f"{len(self._waiters)} writes are already waiting for DRAM room "
                "(write-wait-queue); retry later"
            )
        waiter = _Waiter(key, nbytes, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self.waited += 1
        self.placement.kick_now()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._serve(), name="kv room")
        try:
            async with asyncio.timeout(seconds):
                return await asyncio.shield(waiter.future)
        except TimeoutError:
            self.timeouts += 1
            self._give_up(waiter)
            raise OutOfMemoryError(
                f"no DRAM room for {nbytes} bytes within {seconds:g} s (write-wait-timeout)"
            ) from None
        except asyncio.CancelledError:
            self._give_up(waiter)
            raise

    def _give_up(self, waiter: _Waiter) -> None:
        """A waiter left (timeout, cancel): free what the room maker may have reserved."""
        if not waiter.future.done():
            waiter.future.cancel()
            try:
                self._waiters.remove(waiter)  # O(queue), bounded by write-wait-queue
            except ValueError:
                pass
            return
        if isinstance(waiter.future.result(), memoryview) and waiter.key is not None:
            dram = self.placement.state.dram
            assert dram is not None
            dram.abort(waiter.key)

    def _serve_fitting(self) -> bool:
        """Hand room to waiters at the head, in order, while they fit. True when it stopped
        after a waiter that only waited for room (it reserves itself: let it run first)."""
        dram = self.placement.state.dram
        assert dram is not None
        while self._waiters:
            head = self._waiters[0]
            if head.future.done():  # gave up
                self._waiters.popleft()
                continue
            result: memoryview | bool
            if head.key is None:
                if self.placement.free_for(dram) < head.nbytes:
                    return False
                result = True
            else:
                try:
                    result = dram.reserve(head.key, head.nbytes)
                except TierFull:
                    return False
            self._waiters.popleft()
            head.future.set_result(result)
            if result is True:
                return True
        return False

    async def _serve(self) -> None:
        placement = self.placement
        dram = placement.state.dram
        assert dram is not None
        i = placement.state.tier_index(dram.name)
        while self._waiters:
            if self._serve_fitting():
                for _ in range(_HANDOVER_STEPS):
                    await asyncio.sleep(0)  # the promotion takes its slot before the next
                continue
            if not self._waiters:
                return
            ahead = [w for w in list(self._waiters)[:_AHEAD] if not w.future.done()]
            need = sum(w.nbytes for w in ahead) - placement.free_for(dram)
            if ahead and ahead[0].nbytes > dram.capacity:
                self._fail_head()
                continue
            if need > 0 and not await placement.evict_round(i, need):
                if await placement.eviction_ended():
                    continue  # the demoter's round held the leaves: room or new leaves now
                self._serve_fitting()
                if self._waiters and not await placement.evict_round(i, self._waiters[0].nbytes):
                    self._fail_head()  # nothing can leave: the usual OOM, not an endless wait

    def _fail_head(self) -> None:
        while self._waiters:
            head = self._waiters.popleft()
            if not head.future.done():
                head.future.set_result(None)
                return
