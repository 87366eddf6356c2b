"""kvstrata's KV events decoded by vLLM 0.33's own ``vllm.distributed.kv_events`` classes
(``msgspec.msgpack.Decoder(type=KVEventBatch)``, as vLLM's ``kv_events_subscriber.py`` and the
routers built on that format decode them), from a real ``kvstrata serve`` subprocess over
loopback ZMQ: the exact event sequence of a chain's life across the tiers, sequence numbers,
a gap recovered through the replay socket, and vLLM's own block hashes for the vLLM tier."""

from __future__ import annotations

import hashlib
import time

import msgspec
import pytest
import redis
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.kv_offload.base import ReqContext

from tests.conftest import free_port
from tests.engines.vllm.harness import TOKENS_PER_BLOCK, Instance, chain_keys
from tests.events_sub import Subscriber, next_seq, wait_events

NS = "llama-3.1-8b@bf16@tp1r0@c16"
CPU, DISK = "CPU_PINNED", "DISK"
_DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def _decode(payload: bytes) -> list:
    batch = _DECODER.decode(payload)
    assert batch.data_parallel_rank == 0
    return batch.events


def _wire(h: bytes) -> int:
    return int.from_bytes(h, "big") & (2**64 - 1)


def _short(ev) -> tuple:
    if isinstance(ev, AllBlocksCleared):
        return ("cleared",)
    kind = "stored" if isinstance(ev, BlockStored) else "removed"
    assert isinstance(ev, BlockStored | BlockRemoved)
    assert len(ev.block_hashes) == 1
    return (kind, ev.block_hashes[0], ev.medium)


@pytest.fixture
def node(make_process_server):
    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    models = "llama-3.1-8b@*=meta-llama/Llama-3.1-8B;3;ad"
    srv = make_process_server(
        kv_events_endpoint=pub, kv_events_replay_endpoint=rep, kv_events_models=models
    )
    sub = Subscriber(pub, rep)
    yield srv, redis.Redis(port=srv.port, socket_timeout=30), sub
    sub.close()


def _wait(r: redis.Redis, what: str, cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond(r.info("tiers")):
        assert time.monotonic() < deadline, f"the server never got to: {what}"
        time.sleep(0.02)


def test_a_chain_through_the_tiers_decoded_by_vllm(node) -> None:
    """Scenario: a chain of three chunks (with token ids) is stored in DRAM, demoted to NVMe
    (the DRAM watermarks lowered), evicted from NVMe (its watermarks lowered), then two more
    chunks are stored, one deleted, and everything flushed. vLLM's decoder reads exactly:
    AllBlocksCleared (start); three BlockStored CPU_PINNED; per chunk, leaf first,
    BlockStored DISK then BlockRemoved CPU_PINNED; three BlockRemoved DISK, leaf first; two
    BlockStored, one BlockRemoved; AllBlocksCleared. The subscriber's stream is closed during
    the demotion: those messages come back through the replay socket, and every sequence
    number from 0 on is received exactly once."""
    _srv, r, sub = node
    h = [hashlib.sha256(b"chain%d" % i).digest() for i in range(5)]
    w = [_wire(x) for x in h]
    payload = b"k" * 65536
    for i in range(3):
        ids = b"".join((16 * i + t).to_bytes(4, "little") for t in range(16))
        r.execute_command("KV.PUT", NS, h[i], h[i - 1] if i else b"", payload, "TOKENIDS", ids)
    first = wait_events(r, sub, _decode, 4)
    seen_live = next_seq(r)

    sub.close_stream()  # the router goes away during the demotion
    r.config_set("dram-low-watermark", "0.0001")
    r.execute_command("CONFIG", "SET", "dram-high-watermark", "0.0001")
    _wait(r, "all three in NVMe only", lambda t: t["dram_chunks"] == 0 and t["nvme_chunks"] == 3)
    r.execute_command("CONFIG", "SET", "dram-high-watermark", "0.95", "dram-low-watermark", "0.85")
    demoted_until = next_seq(r)
    sub.open()

    r.execute_command("CONFIG", "SET", "nvme-low-watermark", "0.0001", "nvme-high-watermark",
                      "0.0001")  # fmt: skip
    _wait(r, "evicted from NVMe", lambda t: t["nvme_chunks"] == 0 and t["kv_chunks"] == 0)
    r.execute_command("CONFIG", "SET", "nvme-high-watermark", "0.95", "nvme-low-watermark", "0.85")
    r.execute_command("KV.PUT", NS, h[3], b"", payload, "TOKENS", 16)
    r.execute_command("KV.PUT", NS, h[4], h[3], payload, "TOKENS", 16)
    assert r.execute_command("KV.DEL", NS, h[4]) == 1
    r.flushall()
    events = wait_events(r, sub, _decode, 17)

    assert [_short(ev) for _, ev in events] == [
        ("cleared",),
        ("stored", w[0], CPU), ("stored", w[1], CPU), ("stored", w[2], CPU),
        ("stored", w[2], DISK), ("removed", w[2], CPU),
        ("stored", w[1], DISK), ("removed", w[1], CPU),
        ("stored", w[0], DISK), ("removed", w[0], CPU),
        ("removed", w[2], DISK), ("removed", w[1], DISK), ("removed", w[0], DISK),
        ("stored", w[3], CPU), ("stored", w[4], CPU), ("removed", w[4], CPU),
        ("cleared",),
    ]  # fmt: skip
    assert len(first) == 4
    # sequence numbers: every one from 0 to the last, each once
    assert sorted(sub.messages) == list(range(next_seq(r)))
    replayed = {s for s, (_t, _p, src) in sub.messages.items() if src == "replay"}
    assert set(range(seen_live, demoted_until)) <= replayed and sub.replays >= 1
    stored = [ev for _, ev in events if isinstance(ev, BlockStored)]
    chain = {ev.block_hashes[0]: ev for ev in stored if ev.medium == CPU}
    assert chain[w[1]].parent_block_hash == w[0] and chain[w[0]].parent_block_hash is None
    assert chain[w[1]].token_ids == list(range(16, 32))
    assert next(ev.token_ids for ev in stored if ev.medium == DISK) == list(range(32, 48))
    assert {(ev.block_size, ev.lora_id, ev.lora_name) for ev in stored} == {(16, 3, "ad")}
    info = r.info("events")
    assert info["kv_events_replay_requests"] >= 1 and info["kv_events_token_chunks"] == 0


def test_the_vllm_tier_reports_vllm_block_hashes(make_process_server) -> None:
    """Scenario: vLLM's own offloading tier (KvstrataTier, built by SecondaryTierFactory) stores
    a chain of offload keys; the events name each block by exactly the hash vLLM's own events
    use for it (``maybe_convert_block_hash`` of the block hash), with the parent's and the KV
    cache group (``group_idx``), on the CPU_PINNED medium."""
    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    srv = make_process_server(kv_events_endpoint=pub, kv_events_replay_endpoint=rep)
    sub = Subscriber(pub, rep)
    inst = Instance(srv.port)
    try:
        keys = chain_keys(3, salt=b"events")
        inst.fill([0, 1, 2], seed=1)
        result = inst.wait(inst.store(keys, [0, 1, 2], ReqContext(req_id="r1")))
        assert result.success
        r = redis.Redis(port=srv.port)
        stored = [ev for _, ev in wait_events(r, sub, _decode, 4)
                  if isinstance(ev, BlockStored)]  # fmt: skip
        block = [bytes(k)[:-4] for k in keys]
        assert [ev.block_hashes for ev in stored] == [[maybe_convert_block_hash(b)] for b in block]
        assert [ev.parent_block_hash for ev in stored] == [
            None, maybe_convert_block_hash(block[0]), maybe_convert_block_hash(block[1])
        ]  # fmt: skip
        assert {(ev.group_idx, ev.medium, ev.block_size) for ev in stored} == {
            (0, CPU, TOKENS_PER_BLOCK)
        }
    finally:
        inst.tier.shutdown()
        sub.close()
