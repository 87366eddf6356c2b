"""The vLLM tier's recent-hit cache (issue 31) against a real ``kvstrata serve``: a chunk this tier
stored or saw matched a moment ago is a ``HIT`` on the scheduler's first scan, with no
``KV.MATCH``; a remembered hit that went stale only makes the load miss (``successful_keys``),
after which the key is a miss for every request; misses are never remembered; the step's
lookups of several requests go out in one pipelined round trip."""

from __future__ import annotations

import select
import socket
import time

import redis
from vllm.v1.kv_offload.base import LookupResult, ReqContext

from kvstrata.clients import Client
from tests.engines.vllm.harness import END, Instance, chain_keys

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY


def match_calls(port: int) -> int:
    with redis.Redis(port=port) as r:
        stats = r.info("commandstats").get("cmdstat_kv.match")
    return 0 if stats is None else int(stats["calls"])


def first_scan(a: Instance, keys, ctx: ReqContext) -> list[LookupResult]:
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, (i + 1) * 16)
    return [a.tier.lookup(k, ctx) for k in keys]


def test_own_stores_hit_on_the_first_scan_without_a_round_trip(instances, server) -> None:
    a = instances()
    keys = chain_keys(5, b"own")
    a.fill(range(5), seed=1)
    assert a.wait(a.store(keys, range(5), ReqContext("w"))).success
    before = match_calls(server.port)
    assert first_scan(a, keys, ReqContext("r")) == [HIT] * 5
    assert match_calls(server.port) == before
    assert a.wait(a.load(keys, [8, 9, 10, 11, 12], ReqContext("r"))).success


def test_matched_hits_are_remembered_misses_are_not(instances, server) -> None:
    """Another instance's chunks: the first request asks the server (RETRY, then the verdict);
    a second request for the same prefix hits at once. A key that missed is asked again, and
    hits once another instance has stored it."""
    a, b = instances(), instances()
    keys = chain_keys(4, b"theirs")
    a.fill(range(3), seed=2)
    assert a.wait(a.store(keys[:3], range(3), ReqContext("w"))).success
    assert first_scan(b, keys, ReqContext("r1")) == [RETRY] * 4
    assert b.lookup(keys, ReqContext("r1")) == [HIT, HIT, HIT, MISS]
    calls = match_calls(server.port)
    assert first_scan(b, keys, ReqContext("r2")) == [HIT, HIT, HIT, RETRY]
    a.fill([3], seed=3)
    assert a.wait(a.store(keys[3:], [3], ReqContext("w2"))).success
    assert b.lookup(keys, ReqContext("r2")) == [HIT] * 4
    assert match_calls(server.port) == calls + 1  # only the missing key went to the server


def test_a_stale_hit_only_makes_the_load_miss_then_it_is_forgotten(instances, server) -> None:
    """The server evicts a chunk this tier remembers: the lookup still says HIT (it cannot
    know), the load lands the other keys and names them in successful_keys, and from then on
    the evicted key misses for every request (it is asked of the server again)."""
    a = instances()
    keys = chain_keys(3, b"stale")
    a.fill(range(3), seed=4)
    assert a.wait(a.store(keys, range(3), ReqContext("w"))).success
    with Client(port=server.port) as kv:
        assert kv.delete(a.tier.namespace, keys[1]) == 1
    assert first_scan(a, keys, ReqContext("r")) == [HIT] * 3
    result = a.wait(a.load(keys, [6, 7, 8], ReqContext("r")))
    assert not result.success and set(result.successful_keys) == {keys[0], keys[2]}
    assert first_scan(a, keys, ReqContext("r2")) == [HIT, RETRY, HIT]
    assert a.lookup(keys, ReqContext("r2")) == [HIT, MISS, HIT]


def test_cache_off_asks_the_server_every_time(instances) -> None:
    a = instances(lookup_cache_s=0)
    keys = chain_keys(2, b"off")
    a.fill(range(2), seed=5)
    assert a.wait(a.store(keys, range(2), ReqContext("w"))).success
    assert first_scan(a, keys, ReqContext("r")) == [RETRY, RETRY]
    assert a.lookup(keys, ReqContext("r")) == [HIT, HIT]


def wait_connected(a: Instance, timeout: float = 30.0) -> None:
    """Until the tier's lookup connection (made on its lookup thread) is up."""
    deadline = time.monotonic() + timeout
    while a.tier._lookup_conn is None or a.tier._connecting:
        assert time.monotonic() < deadline, "the lookup connection never came up"
        a.tier._lookups.submit(lambda: None).result(timeout)  # its queue has run


def wait_replies(a: Instance, timeout: float = 30.0) -> None:
    """Until the replies of what the tier sent on its lookup connection have been read."""
    deadline = time.monotonic() + timeout
    while a.tier._sent:
        conn = a.tier._lookup_conn
        if conn is not None and not conn.closed:
            select.select([conn._sock], [], [], 0.5)  # wake when bytes come
        a.tier.on_schedule_end(END)
        assert time.monotonic() < deadline, "KV.MATCH replies never came"


def test_one_steps_lookups_share_one_round_trip(instances, server) -> None:
    """Two requests queued in one step: one on_schedule_end writes both chains (two KV.MATCH
    calls, pipelined) on the scheduler's lookup connection, no thread hand-off, and both
    resolve from that single round trip."""
    a, b = instances(), instances()
    k1, k2 = chain_keys(2, b"one"), chain_keys(3, b"two")
    a.fill(range(5), seed=6)
    assert a.wait(a.store(k1 + k2, range(5), ReqContext("w"))).success
    wait_connected(b)
    c1, c2 = ReqContext("q1"), ReqContext("q2")
    assert first_scan(b, k1, c1) == [RETRY] * 2 and first_scan(b, k2, c2) == [RETRY] * 3
    before = match_calls(server.port)
    b.tier.on_schedule_end(END)
    assert len(b.tier._sent) == 1 and not b.tier._matching  # written here, not handed off
    assert [b.tier.lookup(k, c1) for k in k1] in ([RETRY] * 2, [HIT] * 2)
    wait_replies(b)
    assert [b.tier.lookup(k, c1) for k in k1] == [HIT] * 2
    assert [b.tier.lookup(k, c2) for k in k2] == [HIT] * 3
    assert match_calls(server.port) == before + 2


def test_long_chains_resolve_exactly(instances, server) -> None:
    """A 300-key chain of which the first 200 are stored (the one-join encoding of a long
    chain, the bulk verdicts): exactly the stored keys hit, on the scheduler's connection."""
    import numpy as np

    a = instances()
    b = instances()
    keys = chain_keys(300, b"long")
    a.fill(range(16), seed=9)
    for i in range(0, 200, 16):  # 16 rows at a time: the primary buffer's size
        part = keys[i : min(i + 16, 200)]
        ctx = ReqContext(f"w{i}")
        for j, k in enumerate(keys[: i + len(part)]):
            ctx.set_offload_key_position(k, (j + 1) * 16)
        a.next_job += 1
        from vllm.v1.kv_offload.tiering.base import TransferJob

        job = TransferJob(a.next_job, part, np.arange(len(part), dtype=np.int32), False, ctx)
        a.tier.submit_store(job)
        assert a.wait(job.job_id).success
    wait_connected(b)
    assert b.lookup(keys, ReqContext("r")) == [HIT] * 200 + [MISS] * 100
    assert not b.tier._matching  # no step went the thread's way


def test_a_lost_lookup_connection_misses_what_was_in_flight(instances, server) -> None:
    """The lookup connection fails with a KV.MATCH in flight: its keys miss (never a hit),
    the recent-hit cache is cleared, and the connection comes back for the next request."""
    a, b = instances(), instances()
    keys = chain_keys(3, b"lost")
    a.fill(range(3), seed=10)
    assert a.wait(a.store(keys, range(3), ReqContext("w"))).success
    wait_connected(b)
    ctx = ReqContext("r")
    assert first_scan(b, keys, ctx) == [RETRY] * 3
    b.tier.on_schedule_end(END)
    assert b.tier._sent
    conn = b.tier._lookup_conn

    def lost(count: int) -> None:  # the connection dies before its reply is read (a server
        raise ConnectionResetError("connection lost")  # may answer at once: not left to luck)

    conn.receive_ready = lost
    conn._sock.shutdown(socket.SHUT_RDWR)
    wait_replies(b)
    assert [b.tier.lookup(k, ctx) for k in keys] == [MISS] * 3
    assert len(b.tier._hits) == 0
    wait_connected(b)
    assert b.lookup(keys, ReqContext("r2")) == [HIT] * 3


def test_no_reply_in_time_is_a_miss(instances, server) -> None:
    """A reply that does not come within timeout_s (a hung server): every key in flight
    misses and the connection is dropped (its stream is out of step)."""
    a = instances(timeout_s=0.5)
    keys = chain_keys(2, b"hung")
    a.fill(range(2), seed=11)
    assert a.wait(a.store(keys, range(2), ReqContext("w"))).success
    a.tier._hits.clear()
    wait_connected(a)
    conn = a.tier._lookup_conn
    conn.receive_ready = lambda count: None  # the server never answers
    ctx = ReqContext("r")
    assert first_scan(a, keys, ctx) == [RETRY] * 2
    a.tier.on_schedule_end(END)
    assert a.tier._sent
    assert [a.tier.lookup(k, ctx) for k in keys] == [RETRY, RETRY]  # within timeout_s
    a.tier._sent[0].at -= 1.0  # sent 1 s ago: past timeout_s
    a.tier.on_schedule_end(END)
    assert not a.tier._sent
    assert [a.tier.lookup(k, ctx) for k in keys] == [MISS, MISS]
    assert conn.closed


def test_steps_go_to_the_lookup_thread_while_not_connected(instances, server) -> None:
    """No lookup connection (not up yet, or lost): the step's KV.MATCH runs on the lookup
    thread as before, with the same verdicts."""
    a = instances()
    keys = chain_keys(3, b"thread")
    a.fill(range(2), seed=12)
    assert a.wait(a.store(keys[:2], range(2), ReqContext("w"))).success
    a.tier._hits.clear()
    wait_connected(a)
    a.tier._close_lookups()
    a.tier._connecting = True  # (keeps it down for this test)
    ctx = ReqContext("r")
    assert first_scan(a, keys, ctx) == [RETRY] * 3
    a.tier.on_schedule_end(END)
    assert not a.tier._sent and a.tier._matching
    for future in list(a.tier._matching):
        future.result(30)
    assert [a.tier.lookup(k, ctx) for k in keys] == [HIT, HIT, MISS]


def test_a_store_after_cached_hits_links_to_the_last_hit(instances, server) -> None:
    """A request whose prefix hit from the cache then stores its next chunk: the new chunk's
    parent on the server is the last cached hit (the chain stays linked for eviction)."""
    import numpy as np
    from vllm.v1.kv_offload.tiering.base import TransferJob

    a = instances()
    keys = chain_keys(4, b"link")
    a.fill(range(4), seed=7)
    assert a.wait(a.store(keys[:3], range(3), ReqContext("w"))).success
    ctx = ReqContext("r")
    assert first_scan(a, keys[:3], ctx) == [HIT] * 3
    ctx.set_offload_key_position(keys[3], 4 * 16)
    a.next_job += 1
    job = TransferJob(job_id=a.next_job, keys=[keys[3]], chunk_ids=np.array([3], dtype=np.int32),
                      is_promotion=False, req_context=ctx)  # fmt: skip
    a.tier.submit_store(job)
    assert a.wait(job.job_id).success
    with Client(port=server.port) as kv:
        got = kv.info(a.tier.namespace, keys[3])
    assert got is not None and got["parent"] in (keys[2].hex(), keys[2].hex().encode())
