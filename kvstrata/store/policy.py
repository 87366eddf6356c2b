"""The placement policy as pure decisions, shared by the server and the simulator.

:class:`~kvstrata.store.placement.Placement` (real tiers, awaited I/O) and
:class:`~kvstrata.sim.engine.Simulator` (virtual tiers that hold sizes, no bytes) both decide
through these functions, so a capacity plan replays the policy the server runs, not a copy:

- watermarks per tier (:func:`tier_policy`, :func:`is_bounded`, :func:`above_high`: a
  promotion still landing in a tier does not wake its demoter, its commit does);
- victim choice: least recently used among the chunks with no resident child in the tier,
  never pinned, leased or moving (:func:`pick_victims` over the tier's
  :class:`~kvstrata.store.lru.LruHeap`, :func:`eligible`);
- where a victim goes (:func:`write_back_needed`) and how its leaving is counted
  (:func:`leaving_counter`: a demotion while another tier still holds it, else an eviction).

No I/O, no asyncio, no tiers: only records, heaps and numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvstrata.store.index import ChunkRecord
from kvstrata.store.lru import LruHeap


@dataclass(frozen=True, slots=True)
class TierPolicy:
    """Watermarks (fill ratios; None = unbounded) and write policy of one tier."""

    name: str
    high: float | None
    low: float | None
    write_through: bool


def tier_policy(values: Mapping[str, Any], name: str) -> TierPolicy:
    """The policy of tier ``name`` from config values (``{tier}-high-watermark`` …)."""
    high = values.get(f"{name}-high-watermark")
    low = values.get(f"{name}-low-watermark")
    wt = values.get(f"{name}-write-policy") == "write-through"
    return TierPolicy(name, high, low if low is not None else high, wt)


def is_bounded(pol: TierPolicy, capacity: int) -> bool:
    return pol.high is not None and capacity > 0


def above_high(pol: TierPolicy, capacity: int, used: float, landing: int = 0) -> bool:
    """Whether the demoter acts on a tier: above its high mark counting committed bytes only.
    ``landing``: bytes of promotions into the tier still in flight (reserved, their chunks not
    in the index yet). They do not count: while a chunk lands, its parent still looks like a
    leaf and would be picked as a victim that the finished promotion rules out; the promotion's
    commit wakes the demoter instead, so victims are chosen with the chunk in place."""
    used -= landing
    return pol.high is not None and capacity > 0 and used > pol.high * capacity


def eligible(rec: ChunkRecord) -> bool:
    """A candidate may leave now: alive, not pinned, not being moved, not leased."""
    return rec.alive and not rec.pins and not rec.moving and not rec.leases


def pick_victims(heap: LruHeap, need: int) -> list[ChunkRecord]:
    """Pop LRU leaf candidates from ``heap`` adding up to at least ``need`` bytes; skipped
    (ineligible) candidates are put back."""
    victims: list[ChunkRecord] = []
    skipped: list[ChunkRecord] = []
    got = 0
    while got < need:
        rec = heap.pop()
        if rec is None:
            break
        if not eligible(rec):
            skipped.append(rec)
            continue
        victims.append(rec)
        got += rec.size
    for rec in skipped:
        heap.requeue(rec)
    return victims


def write_back_needed(rec: ChunkRecord, lower: Sequence[str], shared: Sequence[str]) -> bool:
    """Whether a victim leaving a tier must first be written to a tier in ``lower`` (the
    tiers below it, fast to slow; ``shared`` names those that are shared, e.g. s3): not when a
    lower local tier holds it, nor when only shared tiers are below and one holds it."""
    if not lower:
        return False
    local = [t for t in lower if t not in shared]
    if any(t in rec.tiers for t in local):
        return False
    return not (not local and any(t in rec.tiers for t in lower))


def leaving_counter(rec: ChunkRecord) -> str:
    """The counter a copy that just left a tier adds to: still held elsewhere → demotion."""
    return "demotions" if rec.tiers else "evictions"


def prefetch_budget(pol: TierPolicy, capacity: int) -> int:
    """Bytes of one chain a prefetch may bring into a tier (-1: unbounded): up to its low
    watermark, so a chain larger than the tier does not evict its own first chunks."""
    return int(capacity * (pol.low or 1.0)) if is_bounded(pol, capacity) else -1


def prefetch_todo(
    hashes: Sequence[bytes],
    lookup: Callable[[bytes], ChunkRecord | None],
    target: str,
    budget: int,
    remote: bool = False,
) -> list[bytes]:
    """Hashes worth queueing for a prefetch into ``target``: the prefix that fits ``budget``,
    minus chunks already there; an unknown chunk ends the chain unless a shared tier may
    hold it (``remote``)."""
    out: list[bytes] = []
    total = 0
    for h in hashes:
        rec = lookup(h)
        if rec is None and not remote:
            break
        if rec is not None:
            total += rec.size
            if budget >= 0 and total > budget:
                break
            if target in rec.tiers:
                continue
        out.append(h)
    return out


def chain_to(tail: bytes, lookup: Callable[[bytes], ChunkRecord | None], limit: int) -> list[bytes]:
    """The hashes of the chain ending at ``tail``, root first, following parent links; a
    chunk the index does not know ends the walk."""
    out: list[bytes] = []
    seen: set[bytes] = set()
    h = tail
    while h and h not in seen and len(out) < limit:
        seen.add(h)
        out.append(h)
        rec = lookup(h)
        if rec is None:
            break
        h = rec.parent
    out.reverse()
    return out
