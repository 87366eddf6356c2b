"""The simulated prefetch scheduler (``kvstrata.sim.prefetch``) against the server's rules: a
chunk moves when a worker is free and is ready a transfer later (timely / used late), a chunk
still queued is read from where it is, a full queue drops, an equal queued request is
deduplicated, a session's newer request cancels the older, a deadline abandons what has not
started, ``prefetch-bandwidth`` paces the workers. Also: a lease counts a read where the chunk
was found (before its promotion), on the server and in the simulator alike."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from kvstrata.chunks import ChunkKey
from kvstrata.sim.engine import Simulator
from kvstrata.sim.replay import DEFAULTS, replay
from kvstrata.sim.vtiers import TierSpec
from kvstrata.store.policy import tier_policy
from kvstrata.tracefile import Event, read_trace, write_trace
from tests.fakes import FakeTier, chain, make_dram, open_store

NS = "m"
KIB = 1024
CHUNK = 64 * KIB
#: the slow NVMe link of these tests: 1 MB/s, no latency: a 64 KiB chunk moves in 65.536 ms
NVME_BW = 1e6
MOVE = CHUNK / NVME_BW


def _sim(workers: int = 1, queue: int = 1024, bandwidth: float = 0.0) -> Simulator:
    specs = [
        TierSpec("dram", 64 * CHUNK, 64e9, 0.0, tier_policy(DEFAULTS, "dram")),
        TierSpec("nvme", 1024 * CHUNK, NVME_BW, 0.0, tier_policy(DEFAULTS, "nvme")),
    ]
    return Simulator(specs, workers, queue, bandwidth)


def _cold(sim: Simulator, tag: str, n: int) -> list[bytes]:
    """A chain of n chunks held in NVMe only."""
    hashes = [f"{tag}{i}".encode() for i in range(n)]
    nvme = sim.by_name["nvme"]
    for i, h in enumerate(hashes):
        sim.tick(0)
        sim.put(NS, h, hashes[i - 1] if i else b"", CHUNK, 32)
        rec = sim.index.get(ChunkKey(NS, h))
        assert rec is not None
        if "nvme" not in rec.tiers:
            assert sim.put_with_room(sim.tiers.index(nvme), rec)
        sim._drop(rec, sim.by_name["dram"])
    assert all(_where(sim, h) == {"nvme"} for h in hashes)
    return hashes


def _where(sim: Simulator, h: bytes) -> set[str]:
    rec = sim.index.get(ChunkKey(NS, h))
    return set() if rec is None else set(rec.tiers)


def test_chunks_move_when_a_worker_is_free_timely_late_and_still_queued() -> None:
    """One worker, four chunks of 65.5 ms each, prefetched at t=0 and read at t=0.1: chunk 0
    is ready (timely), chunk 1 is moving (its read waits: used late, a DRAM hit once landed),
    chunk 3 has not started, so its read is an NVMe hit and the worker later skips it."""
    sim = _sim(workers=1)
    hashes = _cold(sim, "a", 4)
    sim.tick(0.0)
    assert sim.prefetch_chain(NS, hashes) == 4
    assert _where(sim, hashes[0]) == {"dram", "nvme"}  # started at once
    assert _where(sim, hashes[1]) == {"nvme"}  # queued behind it
    sim.tick(0.1)  # chunk 1 started at 65.5 ms, chunk 2 will at 131 ms
    assert _where(sim, hashes[1]) == {"dram", "nvme"}
    assert _where(sim, hashes[2]) == {"nvme"}
    dram, nvme = sim.by_name["dram"].counters, sim.by_name["nvme"].counters
    assert sim.get(NS, hashes[0]) == "dram"
    assert sim.get(NS, hashes[1]) == "dram"
    assert sim.get(NS, hashes[3]) == "nvme"
    assert (dram.hits, nvme.hits) == (2, 1)
    assert (sim.prefetch["timely"], sim.prefetch["used_late"]) == (1, 1)
    sim.finish()
    pf = sim.prefetch
    assert (pf["chunks"], pf["skipped"], pf["done"]) == (3, 1, 1)  # chunk 3 was there already


def test_concurrency_moves_chunks_side_by_side() -> None:
    """Four workers move the four chunks together: all are ready after one transfer time."""
    sim = _sim(workers=4)
    hashes = _cold(sim, "a", 4)
    sim.tick(0.0)
    sim.prefetch_chain(NS, hashes)
    sim.tick(MOVE * 1.01)
    for h in hashes:
        assert sim.get(NS, h) == "dram"
    assert (sim.prefetch["timely"], sim.prefetch["used_late"]) == (4, 0)


def test_full_queue_drops_and_equal_queued_request_is_deduplicated() -> None:
    """``prefetch-queue`` 2, one worker busy with A (still queued: its second chunk has not
    started): B is queued, B again is the same queued request (deduped, nothing more moved),
    C finds the queue full (dropped). Once A and B have left the queue, C is accepted."""
    sim = _sim(workers=1, queue=2)
    a, b, c = _cold(sim, "a", 2), _cold(sim, "b", 2), _cold(sim, "c", 2)
    sim.tick(0.0)
    assert sim.prefetch_chain(NS, a) == 2
    assert sim.prefetch_chain(NS, b) == 2
    assert sim.prefetch_chain(NS, b) == 0
    assert sim.prefetch_chain(NS, c) == 0
    pf = sim.prefetch
    assert (pf["requests"], pf["deduped"], pf["dropped"]) == (2, 1, 1)
    sim.tick(10.0)
    assert sim.prefetch_chain(NS, c) == 2
    sim.finish()
    assert (pf["chunks"], pf["done"]) == (6, 3)
    assert all(_where(sim, h) == {"dram", "nvme"} for h in a + b + c)


def test_a_sessions_newer_request_cancels_the_older() -> None:
    """Session s prefetched twice at t=0 (its tail moved on meanwhile): the older request is
    cancelled after its first chunk, so of its chain only what the newer one covers moves."""
    sim = _sim(workers=1)
    old, new = _cold(sim, "o", 4), _cold(sim, "n", 2)
    sim.tick(0.0)
    sim.session(NS, b"s", old[-1])
    assert sim.prefetch_session(NS, b"s") == 4
    sim.session(NS, b"s", new[-1])
    assert sim.prefetch_session(NS, b"s") == 2
    sim.finish()
    pf = sim.prefetch
    assert (pf["requests"], pf["cancelled"], pf["done"]) == (2, 1, 1)
    assert pf["chunks"] == 3  # old[0] (started before the cancel) and new[0..1]
    assert [_where(sim, h) for h in old[1:]] == [{"nvme"}] * 3


def test_deadline_abandons_chunks_not_started_and_counts_late() -> None:
    """A 100 ms deadline on four 65.5 ms chunks with one worker: chunks 0 and 1 start before
    it, 2 and 3 would start after it and are abandoned; the request is late."""
    sim = _sim(workers=1)
    hashes = _cold(sim, "a", 4)
    sim.tick(0.0)
    sim.prefetch_chain(NS, hashes, deadline_ms=100)
    sim.finish()
    pf = sim.prefetch
    assert (pf["late"], pf["done"], pf["chunks"], pf["abandoned"]) == (1, 0, 2, 2)
    assert [len(_where(sim, h)) for h in hashes] == [2, 2, 1, 1]


def test_prefetch_bandwidth_paces_the_workers() -> None:
    """Four workers but ``prefetch-bandwidth`` of half the link: each chunk waits for the
    budget the previous one used, so at one transfer time only the first is ready."""
    sim = _sim(workers=4, bandwidth=NVME_BW / 2)
    hashes = _cold(sim, "a", 4)
    sim.tick(0.0)
    sim.prefetch_chain(NS, hashes)
    sim.tick(MOVE * 1.01)
    assert [len(_where(sim, h)) for h in hashes] == [2, 1, 1, 1]
    sim.tick(MOVE * 2.02)
    assert [len(_where(sim, h)) for h in hashes] == [2, 2, 1, 1]


def test_replayed_session_prefetch_with_its_chain_cancels_the_older() -> None:
    """The server traces a session's prefetch with the chain it resolved and the session:
    the replay passes the session on, so a newer one cancels the older as on the server."""
    sim = _sim(workers=1)
    old, new = _cold(sim, "o", 4), _cold(sim, "n", 2)
    events = [
        Event(0.0, "prefetch", NS, tuple(old), to="dram", session=b"s"),
        Event(0.0, "prefetch", NS, tuple(new), to="dram", session=b"s"),
    ]
    replay(sim, events)
    assert (sim.prefetch["cancelled"], sim.prefetch["chunks"]) == (1, 3)


def test_lease_counts_the_tier_the_chunk_was_found_in_simulator() -> None:
    """A lease of a chain in NVMe promotes it into DRAM: the reads are NVMe hits (a DRAM miss
    each), the promotions DRAM's; the lease again finds them in DRAM."""
    sim = _sim()
    hashes = _cold(sim, "a", 3)
    sim.tick(1.0)
    assert sim.lease(NS, hashes) == 3
    dram, nvme = sim.by_name["dram"].counters, sim.by_name["nvme"].counters
    assert (nvme.hits, dram.misses, dram.hits, dram.promotions) == (3, 3, 0, 3)
    sim.tick(2.0)
    assert sim.lease(NS, hashes) == 3
    assert (nvme.hits, dram.misses, dram.hits) == (3, 3, 3)


def test_lease_counts_the_tier_the_chunk_was_found_in_server() -> None:
    """The same on the server's store: a lease of a chain held in NVMe counts NVMe hits and
    DRAM misses (and DRAM promotions); a second lease of it counts DRAM hits."""

    async def main() -> None:
        slot = 4096
        async with open_store([make_dram(32 * slot), FakeTier("nvme")]) as store:
            hashes = chain(3, b"h")
            parent = b""
            for i, h in enumerate(hashes):
                assert await store.put(NS, h, parent, bytes([i]) * slot, tokens=4)
                parent = h
            assert await store.placement.make_room(0, store.state.dram.capacity)
            assert store.match_tiers(NS, hashes) == ["nvme"] * 3
            base: dict[str, Any] = store.stats()
            lease = await store.lease(NS, hashes)
            assert lease is not None and len(lease.handles) == 3
            store.release(lease.id)
            s = store.stats()

            def delta(tier: str, counter: str) -> int:
                return int(s[tier][counter]) - int(base[tier][counter])

            assert (delta("nvme", "hits"), delta("dram", "misses"), delta("dram", "hits")) == (
                3,
                3,
                0,
            )
            assert delta("dram", "promotions") == 3
            lease = await store.lease(NS, hashes)
            assert lease is not None
            store.release(lease.id)
            s = store.stats()
            assert (delta("nvme", "hits"), delta("dram", "hits")) == (3, 3)

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_lease_replayed_from_its_start_sees_the_writes_beside_it(tmp_path: Path) -> None:
    """A lease recorded with ``since``: its promotions ran at its start, and the writes the
    server recorded before the lease's record (made while it ran) push the promoted but not
    yet pinned chunks out again, so the lease promotes them twice, as the server does. The
    same trace without ``since`` promotes each once; ``since`` survives a trace's round trip."""
    size = CHUNK

    def run(since: float) -> Simulator:
        sim = _sim()  # DRAM: 64 chunks
        a = _cold(sim, "a", 8)
        events = [
            Event(1.0 + 0.001 * i, "put", NS, (f"b{i}".encode(),), b"", size, 32)
            for i in range(3 * 64)  # three DRAMs full: nothing unpinned from before stays
        ]
        events.append(Event(2.0, "lease", NS, tuple(a), to="dram", lease="L1", since=since))
        path = tmp_path / f"t{since}.jsonl"
        with path.open("w") as f:
            write_trace(events, f)
        replay(sim, list(read_trace(path)))
        return sim

    with_start, without = run(1.5), run(0.0)
    once = without.by_name["dram"].counters.promotions
    twice = with_start.by_name["dram"].counters.promotions
    # (in a fragmented arena a promoted chunk, an old leaf, may make way for the next one)
    assert 8 <= once < 16, once
    assert twice >= 16, (once, twice)  # the writes evicted all 8 before the pins: each twice
    for sim in (with_start, without):
        nvme, dram = sim.by_name["nvme"].counters, sim.by_name["dram"].counters
        assert (nvme.hits, dram.misses) == (8, 8)  # found in NVMe when the lease started


def test_recorded_fetches_move_what_the_servers_workers_moved_when_they_did() -> None:
    """A trace with ``fetch`` records (a server's worker starting a chunk) is replayed by
    them, not by the model's workers: the chunks move at their records, in their order, and
    those the server did not move (its request ended early) stay where they were: a read of
    one is served from NVMe, as the server recorded."""
    sim = _sim(workers=1)
    hashes = _cold(sim, "f", 4)
    events = [
        Event(1.0, "prefetch", NS, tuple(hashes), to="dram"),
        Event(1.0, "fetch", NS, (hashes[0],), to="dram"),
        Event(1.5, "fetch", NS, (hashes[1],), to="dram"),
        Event(2.0, "get", NS, (hashes[2],), tier="nvme"),
    ]
    replay(sim, events)
    assert [_where(sim, h) for h in hashes[:2]] == [{"dram", "nvme"}] * 2
    assert _where(sim, hashes[3]) == {"nvme"}  # (hashes[2] was promoted by its read)
    assert sim.prefetch["chunks"] == 2 and sim.checked == {"reads": 1, "same": 1}
    model = _sim(workers=1)  # the same without fetch records: the model moves all four
    replay(model, [Event(1.0, "prefetch", NS, tuple(_cold(model, "f", 4)), to="dram")])
    assert model.prefetch["chunks"] == 4
