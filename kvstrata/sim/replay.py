"""Runs: tiers from sizes and hardware, a trace or a workload through the simulator, and the
report (per-tier counters with KV.STATS's names, links, prefetch, TTFT and GPU time)."""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable
from dataclasses import dataclass

from kvstrata.config import OPTIONS
from kvstrata.sim.economics import Hardware, Model, load_seconds, recompute_seconds
from kvstrata.sim.engine import MatchResult, Simulator
from kvstrata.sim.ttft import PrefillFit
from kvstrata.sim.vplacement import LEASE_AHEAD
from kvstrata.sim.vtiers import TierSpec
from kvstrata.sim.workload import Workload, drive, generate
from kvstrata.store.policy import tier_policy
from kvstrata.tracefile import Event

DEFAULTS = {o.name: o.default for o in OPTIONS}


@dataclass(frozen=True, slots=True)
class Plan:
    """What one run is asked: tier sizes (None: no such tier), hardware, model, MFU."""

    dram: int | None
    nvme: int | None
    gpu: int | None = None
    s3: bool = False
    model: Model | None = None
    hardware: Hardware | None = None
    mfu: float = 0.5
    chunk_tokens: int = 256
    #: the engine's measured prefill (``--prefill-fit``) instead of FLOPs at ``mfu``
    prefill: PrefillFit | None = None
    #: the server's prefetch scheduler (``prefetch-concurrency``, ``-queue``, ``-bandwidth``)
    prefetch_concurrency: int = int(DEFAULTS["prefetch-concurrency"] or 4)
    prefetch_queue: int = int(DEFAULTS["prefetch-queue"] or 1024)
    prefetch_bandwidth: float = float(DEFAULTS["prefetch-bandwidth"] or 0)


def tier_specs(plan: Plan, hw: Hardware, values: dict | None = None) -> list[TierSpec]:
    """Virtual tiers with the server's default policy (or ``values``: config key → value)."""
    vals = dict(DEFAULTS if values is None else values)
    out = []
    for name, size in (("gpu", plan.gpu), ("dram", plan.dram), ("nvme", plan.nvme)):
        if size is not None:
            bw, lat = hw.links[name]
            slab = int(vals.get("nvme-slab-max") or 0) if name == "nvme" else 0
            out.append(TierSpec(name, size, bw, lat, tier_policy(vals, name), slab))
    if plan.s3:
        bw, lat = hw.links["s3"]
        out.append(TierSpec("s3", 0, bw, lat, tier_policy(vals, "s3")))
    return out


#: not a trace op: where a recorded lease started (its ``t`` minus ``since``)
LEASE_START = "lease-start"


def with_lease_starts(events: list[Event]) -> list[Event]:
    """``events`` with :data:`LEASE_START` s for each lease that says how long it took: its
    start, then a part for each group of its promotions ahead, spread evenly until its
    record, placed among the records by time (a trace is in time order), so that the commands
    the server ran during the lease's promotions come between them."""
    leases = [i for i, ev in enumerate(events) if ev.op == "lease" and ev.since > 0]
    if not leases:
        return events
    times = [ev.t for ev in events]
    at: dict[int, list[Event]] = {}
    for i in leases:
        ev = events[i]
        parts = max(1, -(-len(ev.hashes) // LEASE_AHEAD))  # a group of promotions each
        for k in range(parts):  # (``size`` numbers the part)
            t = ev.t - ev.since * (1 - k / parts)
            j = min(bisect.bisect_right(times, t, 0, i), i)
            start = Event(t, LEASE_START, ev.ns, ev.hashes, size=k, to=ev.to, lease=ev.lease)
            at.setdefault(j, []).append(start)
    out: list[Event] = []
    for j, ev in enumerate(events):
        out.extend(at.get(j, ()))
        out.append(ev)
    return out


def prepare(sim: Simulator, events: list[Event]) -> list[Event]:
    """Set ``sim`` up for what a whole trace records (the server's demoter rounds, its prefetch
    workers' starts) and return the events to :func:`apply`, lease starts added."""
    if any(ev.op == "demote" for ev in events):
        sim.demoter = "recorded"
    if any(ev.op == "fetch" for ev in events):
        sim.prefetcher.recorded = True
    return with_lease_starts(events)


def replay(sim: Simulator, events: Iterable[Event]) -> int:
    """Feed trace events to the simulator; the chunk operations done. A trace that carries the
    server's ``demote`` marks runs the simulated demoter at them (``sim.demoter``); pass a
    list, or set ``sim.demoter`` first when streaming."""
    if isinstance(events, list):
        events = prepare(sim, events)
    n = 0
    for ev in events:
        n += apply(sim, ev)
    sim.finish()
    return n


def _check(sim: Simulator, ev: Event, server: tuple[str, ...], replay: tuple[str, ...]) -> None:
    """Count the reads of one record against the tiers the server recorded for them (a read
    the replay did not do, or did besides, differs too)."""
    n = max(len(server), len(replay))
    same = sum(1 for a, b in zip(server, replay, strict=False) if a == b)
    sim.checked["reads"] += n
    sim.checked["same"] += same
    if same < n and len(sim.differ) < 20:
        sim.differ.append((ev.t, ",".join(server), ",".join(replay)))


def apply(sim: Simulator, ev: Event) -> int:
    """One trace event; the chunk operations it did."""
    op = ev.op
    sim.tick(ev.t)
    if op == "get":
        got = sim.get(ev.ns, ev.hashes[0]) or ""
        if ev.tier is not None:  # the server said which tier served it: compare
            _check(sim, ev, (ev.tier,), (got,))
        return 1
    if op == "put":
        sim.put(ev.ns, ev.hashes[0], ev.parent, ev.size, ev.tokens)
        return 1
    if op == "match":
        sim.match(ev.ns, ev.hashes, ev.tokens, ev.prefetch)
        return len(ev.hashes)
    if op == "lease":
        sim.lease(ev.ns, ev.hashes, ev.to, ev.lease)
        if ev.found:  # the server said which tier each leased chunk was a read of
            _check(sim, ev, ev.found, tuple(sim.counted))
        return len(ev.hashes)
    if op == "del":
        sim.delete_key(ev.ns, ev.hashes[0])
        return 1
    if op == "session":
        assert ev.session is not None
        sim.session(ev.ns, ev.session, ev.hashes[0], ev.ttl or 3_600_000)
        return 1
    if op == "prefetch":
        if ev.session is not None and not ev.hashes:
            return sim.prefetch_session(ev.ns, ev.session, ev.to, ev.deadline) + 1
        sim.prefetch_chain(ev.ns, ev.hashes, ev.to, ev.deadline, ev.session)
        return len(ev.hashes)
    if op == LEASE_START:
        sim.lease_start(ev.ns, ev.hashes, ev.to, ev.lease, ev.size)
    elif op == "release":
        sim.release(ev.lease)
    elif op == "reserve":
        sim.reserve(ev.ns, ev.hashes[0], ev.size)
    elif op == "abort":
        sim.abort(ev.ns, ev.hashes[0])
    elif op == "demote":
        sim.demote(ev.to)
    elif op == "demoted":
        sim.demoted()
    elif op == "fetch":
        sim.prefetcher.fetched(ev.ns, ev.hashes[0], ev.to or "dram")
    return 0


class Ticking:
    """The simulator as a :func:`~kvstrata.sim.workload.drive` target: every command ticks
    the clock first, as every command of a replayed trace does (the same LRU order)."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self.t = 0.0

    def match(self, ns: str, hashes: tuple[bytes, ...], tokens: int) -> int:
        self.sim.tick(self.t)
        return self.sim.match(ns, hashes, tokens)

    def get(self, ns: str, h: bytes) -> object:
        self.sim.tick(self.t)
        return self.sim.get(ns, h)

    def put(self, ns: str, h: bytes, parent: bytes, size: int, tokens: int) -> object:
        self.sim.tick(self.t)
        return self.sim.put(ns, h, parent, size, tokens)

    def session(self, ns: str, sid: bytes, tail: bytes) -> object:
        self.sim.tick(self.t)
        self.sim.session(ns, sid, tail)
        return None

    def prefetch_session(self, ns: str, sid: bytes, deadline_ms: int = 0) -> object:
        self.sim.tick(self.t)
        return self.sim.prefetch_session(ns, sid, deadline_ms=deadline_ms)


def run_workload(sim: Simulator, wl: Workload, chunk_bytes: int) -> int:
    target = Ticking(sim)
    n = 0
    for item in generate(wl):
        target.t = item.t
        n += drive(target, wl, item, chunk_bytes)
    sim.finish()
    return n


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _ttft(req: MatchResult, plan: Plan, model: Model, hw: Hardware) -> tuple[float, float, int]:
    """(TTFT of the prefill with the cache, without it, cached tokens) of one request."""
    ct = plan.chunk_tokens
    total = req.tokens or req.chunks * ct
    by_tier: dict[str, int] = {}
    cached = 0
    for tier, size, tokens in req.found:
        by_tier[tier] = by_tier.get(tier, 0) + size
        cached += tokens or ct
    cached = min(cached, total)
    load = sum(load_seconds(b, hw.links[t]) for t, b in by_tier.items())
    if plan.prefill is not None:  # the engine's own prefill, fitted to measured requests
        fit = plan.prefill
        return load + fit.seconds(total - cached, cached), fit.seconds(total), cached
    rest = recompute_seconds(model, total - cached, hw, plan.mfu)
    return load + rest, recompute_seconds(model, total, hw, plan.mfu), cached


def report(sim: Simulator, plan: Plan, wall: float, chunk_ops: int) -> dict:
    """The run's figures as one JSON-ready dict (``tiers`` keyed like KV.STATS)."""
    assert plan.model is not None and plan.hardware is not None
    tiers: dict[str, dict[str, float | None]] = {}
    for t in sim.tiers:
        c: dict[str, float] = dict(t.counters.as_dict())
        looked = c["hits"] + c["misses"]
        c.update(capacity=t.capacity, used=t.used, chunks=sim.index.count_in.get(t.name, 0))
        tiers[t.name] = {**c, "hit_ratio": round(c["hits"] / looked, 4) if looked else None}
    with_cache, without, cached, total = [], [], 0, 0
    for req in sim.requests:
        a, b, n = _ttft(req, plan, plan.model, plan.hardware)
        with_cache.append(a)
        without.append(b)
        cached += n
        total += req.tokens or req.chunks * plan.chunk_tokens
    return {
        "model": plan.model.name,
        "hardware": plan.hardware.name,
        "mfu": plan.mfu,
        "prefill": plan.prefill.describe() if plan.prefill is not None else None,
        "ops": sim.ops,
        "chunk_ops": chunk_ops,
        "seconds": round(wall, 3),
        "chunk_ops_per_second": round(chunk_ops / wall) if wall > 0 else 0,
        "tiers": tiers,
        "links": dict(sim.links),
        "prefetch": dict(sim.prefetch),
        "oom": sim.oom,
        # a trace whose get records say which tier served each: how many the replay agrees on
        "reads_checked": dict(sim.checked),
        "requests": len(sim.requests),
        "tokens": {"prompt": total, "cached": cached},
        "token_hit_ratio": round(cached / total, 4) if total else 0.0,
        "ttft": {
            "p50": _pct(with_cache, 0.5),
            "p99": _pct(with_cache, 0.99),
            "recompute_p50": _pct(without, 0.5),
            "recompute_p99": _pct(without, 0.99),
        },
        "gpu_seconds": {
            "prefill": round(sum(with_cache), 3),
            "recompute": round(sum(without), 3),
            "saved": round(sum(without) - sum(with_cache), 3),
        },
    }


def run(plan: Plan, events: list[Event] | None, wl: Workload | None) -> dict:
    """One simulation of a trace (``events``) or a workload with ``plan``'s tiers."""
    assert plan.model is not None and plan.hardware is not None
    sim = Simulator(
        tier_specs(plan, plan.hardware),
        plan.prefetch_concurrency,
        plan.prefetch_queue,
        plan.prefetch_bandwidth,
    )
    start = time.perf_counter()
    if events is not None:
        n = replay(sim, events)
    else:
        assert wl is not None
        size = wl.chunk_bytes or int(plan.model.kv_size(wl.chunk_tokens))
        n = run_workload(sim, wl, size)
    return report(sim, plan, time.perf_counter() - start, n)
