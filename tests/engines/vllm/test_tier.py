"""The kvstrata tier as vLLM 0.33 builds it (``SecondaryTierFactory`` from a tier config, a
real ``OffloadingSpec``/``OffloadingConfig``, a numpy primary buffer) against a real
``kvstrata serve`` subprocess on loopback."""

from __future__ import annotations

import logging
import os
import signal
import time

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext

from kvstrata.clients import Client
from kvstrata.clients.vllm import KvstrataTier
from kvstrata.clients.vllm_keys import vllm_namespace
from tests.conftest import free_port
from tests.engines.vllm.harness import ROW_BYTES, Instance, chain_keys, offloading_config

HIT, MISS = LookupResult.HIT, LookupResult.MISS


@pytest.mark.parametrize("load", ["auto", "mget"])
def test_stored_chunks_hit_and_load_exactly(instances, load) -> None:
    """Scenario: a store job of 4 rows, then lookups (one KV.MATCH for the chain) hit exactly
    those 4 keys, and a load job brings their exact bytes into other rows (lease + memcpy on
    the same host, or KV.MGET received in place)."""
    a = instances(load=load)
    assert isinstance(a.tier, KvstrataTier)
    keys = chain_keys(6)
    a.fill(range(4), seed=1)
    assert a.wait(a.store(keys[:4], [0, 1, 2, 3], ReqContext("r1"))).success
    assert a.lookup(keys, ReqContext("r2")) == [HIT] * 4 + [MISS] * 2
    result = a.wait(a.load(keys[:4], [8, 9, 10, 11], ReqContext("r2")))
    assert result.success and result.transfer_bytes == 4 * ROW_BYTES
    np.testing.assert_array_equal(a.buffer[8:12], a.buffer[0:4])
    assert a.tier._mover.shared_memory is (load == "auto")


def test_two_instances_share_one_server(instances) -> None:
    """Scenario: two vLLM instances (other engine ids, same model and layout) on one host:
    what one stores, the other finds and loads."""
    a = instances(config=offloading_config(engine_id="a"))
    b = instances(config=offloading_config(engine_id="b"))
    assert a.tier.namespace == b.tier.namespace
    keys = chain_keys(3, b"shared")
    a.fill(range(3), seed=2)
    assert a.wait(a.store(keys, [0, 1, 2], ReqContext("a1"))).success
    assert b.lookup(keys, ReqContext("b1")) == [HIT] * 3
    assert b.wait(b.load(keys, [5, 6, 7], ReqContext("b1"))).success
    np.testing.assert_array_equal(b.buffer[5:8], a.buffer[0:3])


@pytest.mark.parametrize(
    "other",
    [{"model": "another/model"}, {"dtype": "bfloat16"}, {"tp": 2}],
    ids=["model", "dtype", "tp"],
)
def test_another_layout_never_hits(instances, other) -> None:
    a = instances()
    b = instances(config=offloading_config(**other))
    assert a.tier.namespace != b.tier.namespace
    keys = chain_keys(2, b"x")
    a.fill(range(2), seed=3)
    assert a.wait(a.store(keys, [0, 1], ReqContext("a"))).success
    assert b.lookup(keys, ReqContext("b")) == [MISS, MISS]
    assert not b.wait(b.load(keys, [4, 5], ReqContext("b"))).success


def test_namespace_never_uses_the_engine_id() -> None:
    one = vllm_namespace(offloading_config(engine_id="x"), ROW_BYTES)
    assert one == vllm_namespace(offloading_config(engine_id="y"), ROW_BYTES)
    assert one.startswith("vllm:kvstrata-test/tiny-llama@float16@h16x1@tp1pp1pcp1dcp1r0@b65536#")
    assert one != vllm_namespace(offloading_config(), ROW_BYTES * 2)
    named = vllm_namespace(offloading_config(), ROW_BYTES, prefix="llama@rev7")
    assert named.startswith("llama_rev7@float16@")


def test_evicted_between_lookup_and_load(instances, server) -> None:
    """Scenario: the lookup hit 4 chunks, then the third is evicted before the load: the job
    fails, names the 3 keys whose rows hold their exact bytes in ``successful_keys``, and the
    evicted key is a miss from then on (no promotion loop)."""
    a = instances()
    keys = chain_keys(4, b"evict")
    a.fill(range(4), seed=4)
    assert a.wait(a.store(keys, [0, 1, 2, 3], ReqContext("w"))).success
    ctx = ReqContext("r")
    assert a.lookup(keys, ctx) == [HIT] * 4
    with Client(port=server.port) as kv:
        assert kv.delete(a.tier.namespace, keys[2]) == 1
    result = a.wait(a.load(keys, [8, 9, 10, 11], ctx))
    assert not result.success
    assert set(result.successful_keys) == {keys[0], keys[1], keys[3]}
    for src, dst in ((0, 8), (1, 9), (3, 11)):
        np.testing.assert_array_equal(a.buffer[dst], a.buffer[src])
    assert a.lookup(keys, ctx) == [HIT, HIT, MISS, HIT]


def test_server_stopped_mid_job_then_restarted(make_process_server, tmp_path) -> None:
    """Scenario: the server hangs (SIGSTOP) while a load is in flight: submit returns at once,
    the job fails on the timeout, lookups miss; the server is killed and a new one starts on
    the same port: the tier reconnects by itself and the next jobs succeed."""
    port = free_port()
    first = make_process_server(port=port, data_dir=tmp_path / "one")
    a = Instance(port, timeout_s=1.0)
    try:
        keys = chain_keys(3, b"restart")
        a.fill(range(3), seed=5)
        assert a.wait(a.store(keys, [0, 1, 2], ReqContext("w"))).success
        assert first.process is not None
        os.kill(first.process.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            load = a.load(keys, [4, 5, 6], ReqContext("r"))
            store = a.store(chain_keys(2, b"more"), [7, 8], ReqContext("w2"))
            assert time.monotonic() - t0 < 0.5  # submit never blocks the scheduler
            assert not a.wait(load).success
            assert not a.wait(store).success
            assert a.lookup(keys, ReqContext("r2")) == [MISS] * 3
        finally:
            first.process.kill()
            first.process.wait()
        make_process_server(port=port, data_dir=tmp_path / "two")
        assert a.wait(a.store(keys, [0, 1, 2], ReqContext("w3"))).success
        assert a.lookup(keys, ReqContext("r3")) == [HIT] * 3
        assert a.wait(a.load(keys, [9, 10, 11], ReqContext("r3"))).success
        np.testing.assert_array_equal(a.buffer[9:12], a.buffer[0:3])
    finally:
        a.tier.shutdown()


def test_server_down_from_the_start_is_a_miss_not_an_error() -> None:
    a = Instance(free_port(), timeout_s=1.0)
    try:
        keys = chain_keys(2, b"down")
        assert a.lookup(keys, ReqContext("r")) == [MISS, MISS]
        assert not a.wait(a.store(keys, [0, 1], ReqContext("w"))).success
        assert not a.wait(a.load(keys, [2, 3], ReqContext("r"))).success
    finally:
        a.tier.shutdown()


def test_out_of_memory_is_a_job_failure(make_process_server) -> None:
    """Scenario: every chunk in the server's DRAM is leased (pinned) and it has no NVMe tier to
    demote to: KV.RESERVE answers -OOM and the store job fails (it never raises)."""
    srv = make_process_server(dram_capacity="1MiB", nvme_capacity="0",
                              dram_high_watermark="1.0", dram_low_watermark="0.9")  # fmt: skip
    a = Instance(srv.port)
    leases = []
    try:
        a.fill([0], seed=6)
        with Client(port=srv.port) as kv:
            for i in range(60):  # 1 MiB holds at most 16 rows: pin each chunk that stays
                key = chain_keys(1, b"pin%d" % i)
                result = a.wait(a.store(key, [0], ReqContext(f"w{i}")))
                if not result.success:
                    break
                lease = kv.lease(a.tier.namespace, key, tier="dram")
                if lease is not None:  # None: evicted at once to stay under the watermark
                    leases.append(lease)
            assert not result.success and 0 < len(leases) <= 16
            for lease in leases:
                lease.release()
            assert a.wait(a.store(chain_keys(1, b"after"), [0], ReqContext("a"))).success
    finally:
        a.tier.shutdown()


def test_a_stuck_store_delays_neither_lookups_nor_loads(instances) -> None:
    """Stores, loads and KV.MATCH run on separate threads: while every store thread is stuck,
    a lookup still resolves and a promotion still lands."""
    import threading

    a = instances(io_threads=1)
    keys = chain_keys(2, b"stuck")
    a.fill(range(2), seed=8)
    assert a.wait(a.store(keys, [0, 1], ReqContext("w"))).success
    gate, store = threading.Event(), a.tier._mover.store
    a.tier._mover.store = lambda items: gate.wait(30) and store(items)
    try:
        stuck = a.store(chain_keys(1, b"later"), [2], ReqContext("w2"))
        assert a.lookup(keys, ReqContext("r")) == [HIT, HIT]
        assert a.wait(a.load(keys, [4, 5], ReqContext("r"))).success
        assert stuck not in a.results
    finally:
        gate.set()
    assert a.wait(stuck).success


def test_each_job_is_reported_once_and_shutdown_cleans_up(instances) -> None:
    a = instances()
    ids = []
    for i in range(8):
        keys = chain_keys(2, bytes([i]))
        ids.append(a.store(keys, [2 * i, 2 * i + 1], ReqContext(f"w{i}")))
    a.tier.drain_jobs()
    seen = [r.job_id for r in a.tier.get_finished_jobs()]
    assert sorted(seen) == ids  # drain_jobs: every result is there after it returns
    assert list(a.tier.get_finished_jobs()) == []
    assert not a.tier.has_pending_work()
    a.tier.shutdown()
    late = a.store(chain_keys(1, b"late"), [0], ReqContext("late"))
    assert a.wait(late).success is False  # submitted after shutdown: a failure, not a raise


def test_unshareable_hash_seed_is_refused(instances, monkeypatch, caplog) -> None:
    """A random per-process hash seed (xxhash without PYTHONHASHSEED) can never be shared:
    the tier says so once and stays out of the way (misses, failed jobs)."""
    from vllm.utils.hashing import sha256, xxhash
    from vllm.v1.core.kv_cache_utils import init_none_hash

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    init_none_hash(xxhash)
    try:
        a = instances()
        keys = chain_keys(1, b"seed")
        with caplog.at_level(logging.ERROR, logger="kvstrata.vllm"):
            assert a.lookup(keys, ReqContext("r")) == [MISS]
        assert "PYTHONHASHSEED" in caplog.text
        assert not a.wait(a.store(keys, [0], ReqContext("w"))).success
    finally:
        init_none_hash(sha256)


def test_unknown_options_are_ignored_bad_ones_refused(server, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="kvstrata.vllm"):
        inst = Instance(server.port, some_future_option=1)
    inst.tier.shutdown()
    assert "some_future_option" in caplog.text
    with pytest.raises(ValueError, match="tls"):
        Instance(server.port, tls={"cafile": "x"})
    with pytest.raises(ValueError, match="scheme"):
        Instance(server.port, url="http://127.0.0.1:1")


def test_tier_over_tls(make_process_server, tmp_path) -> None:
    """The tier reaches a server's tls-port (``tls`` with a CA file); on the same host the
    loads still come from the shared-memory arena."""
    from tests.test_server_core import _self_signed

    cert, key = _self_signed(tmp_path)
    tls_port = free_port()
    make_process_server(tls_port=tls_port, tls_cert_file=cert, tls_key_file=key)
    a = Instance(tls_port, tls={"ca_file": str(cert), "server_name": "localhost"})
    try:
        keys = chain_keys(2, b"tls")
        a.fill(range(2), seed=7)
        assert a.wait(a.store(keys, [0, 1], ReqContext("w"))).success
        assert a.lookup(keys, ReqContext("r")) == [HIT, HIT]
        assert a.wait(a.load(keys, [2, 3], ReqContext("r"))).success
        np.testing.assert_array_equal(a.buffer[2:4], a.buffer[0:2])
    finally:
        a.tier.shutdown()
    b = Instance(tls_port, tls=True, timeout_s=1.0)  # the system CAs do not know this cert
    try:
        assert not b.wait(b.store(chain_keys(1, b"tls2"), [0], ReqContext("w"))).success
    finally:
        b.tier.shutdown()


def test_which_hash_settings_can_share(monkeypatch) -> None:
    """vLLM 0.33: sha256/sha256_cbor hash from a fixed seed (shareable); xxhash* from a random
    one unless PYTHONHASHSEED is set (then shareable between instances that agree on it)."""
    from vllm.v1.core.kv_cache_utils import DEFAULT_NONE_HASH_SEED

    from kvstrata.clients.vllm_keys import shareable_hash_problem

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert shareable_hash_problem("sha256", None) is None
    assert shareable_hash_problem("sha256_cbor", DEFAULT_NONE_HASH_SEED) is None
    assert "PYTHONHASHSEED" in (shareable_hash_problem("xxhash", None) or "")
    assert "PYTHONHASHSEED" in (shareable_hash_problem(None, "3f" * 32) or "")
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert shareable_hash_problem("xxhash_cbor", None) is None
    assert shareable_hash_problem(None, "42") is None
