"""The server's DRAM room maker (``store/room.py``) as a replay plays it from a trace's marks.

A trace recorded by a server that writes ``room``/``roomed`` marks says when each round of its
room maker started (and for how many bytes) and ended. Replaying such a trace, a DRAM
placement that does not fit now — a KV.PUT's chunk (its ``put`` record comes before the room
is made), a prefetch worker's chunk (``fetch``), a lease's promotions ahead — does not make
room itself: it waits, first come first served, as the server's writer does, and the rounds
run at the marks (victims chosen by the simulator from its own tiers, written below at the
``room`` mark, gone at ``roomed``). Before each round and after it, waiters at the head that
fit are served. What happens meanwhile — an expiry of a victim, a read that gives a victim a
reason to stay — changes what the next round must do, as on the server.

A waiter still waiting when the client's next command is replayed (the trace and this
simulator disagree about the room: a recorded round found victims this simulator lacks) is
served as a trace without marks serves it: by making room for it now. A trace without marks
never queues (``Simulator.room_marks`` is False).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstrata.sim.engine import Simulator
    from kvstrata.store.index import ChunkRecord

#: trace ops of the client's commands: a waiter left when one comes is served at once
CLIENT_OPS = frozenset(
    ("put", "get", "match", "lease", "release", "reserve", "abort", "session", "prefetch")
)


@dataclass(slots=True)
class Waiter:
    rec: ChunkRecord
    kind: str  # "put": the chunk's first DRAM copy; "copy": a promotion into DRAM


class SimRoomQueue:
    """See the module docstring."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self.waiters: deque[Waiter] = deque()
        self.waited = 0  # placements that had to queue

    def __len__(self) -> int:
        return len(self.waiters)

    def place(self, rec: ChunkRecord, kind: str) -> bool:
        """Place ``rec`` in DRAM now when it fits and nobody waits ahead; else queue it.
        True: placed now."""
        if not self.waiters and self._try(Waiter(rec, kind)):
            return True
        self.waiters.append(Waiter(rec, kind))
        self.waited += 1
        return False

    def _needed(self, w: Waiter) -> bool:
        dram = self.sim.dram
        assert dram is not None
        rec = w.rec
        if not rec.alive or dram.name in rec.tiers:
            return False
        return w.kind == "put" or bool(rec.tiers)

    def _try(self, w: Waiter) -> bool:
        """Place the waiter if its slot fits now (no room made)."""
        sim = self.sim
        dram = sim.dram
        assert dram is not None
        if dram.free() < dram.spec.footprint(w.rec.size):
            return False
        if w.kind == "put":
            return sim._add(w.rec, dram)
        return sim.copy_into(w.rec, dram, make_room=False)

    def serve(self) -> None:
        """Serve waiters at the head, in order, while they fit (``_serve_fitting``)."""
        while self.waiters:
            head = self.waiters[0]
            if self._needed(head) and not self._try(head):
                return
            self.waiters.popleft()
        self.sim.enforce()

    def flush(self) -> None:
        """The client's next command: waiters left are served by making room for each now
        (what a replay without marks does)."""
        sim = self.sim
        dram = sim.dram
        assert dram is not None
        j = sim.tiers.index(dram)
        while self.waiters:
            w = self.waiters.popleft()
            if not self._needed(w):
                continue
            if w.kind == "put":
                if not sim.put_with_room(j, w.rec):
                    sim.place_below(w.rec)
            else:
                sim.copy_into(w.rec, dram, make_room=True)
        sim.enforce()
