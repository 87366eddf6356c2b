"""Issue 12, plain values: SET/GET obey ``maxmemory`` with Redis's ``maxmemory-policy``, and
large values (>= 64 KiB) live in the tiers (DRAM arena, demoted to NVMe) instead of the heap.

How values are counted is ``kvstrata.store.strings``: a small value counts key + value + 64
bytes, a large one key + 64 (its bytes are bounded by the tiers)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import redis

from kvstrata.protocol.frames import OK
from tests.conftest import RunningServer
from tests.fakectx import FakeCtx, FakeServer, err

KiB, MiB = 1024, 1024 * 1024
OOM = "OOM command not allowed when used memory > 'maxmemory'."


def _fake(**flags: object) -> tuple[FakeServer, FakeCtx]:
    srv = FakeServer(**flags)
    return srv, srv.connect()


def _cost(key: str, value: bytes) -> int:
    return len(key) + len(value) + 64


def test_allkeys_lru_evicts_least_recently_used_small_values() -> None:
    """Scenario: maxmemory 64 KiB, default policy; 40 values of 4 KiB, k0 read after every
    write. Counted memory never exceeds the limit, old keys go, k0 (always recent) stays."""
    srv, c = _fake(maxmemory="64KiB")
    assert srv.config.get("maxmemory-policy") == "allkeys-lru"
    value = b"x" * (4 * KiB)
    for i in range(40):
        assert c.call("SET", f"k{i}", value) == OK
        assert c.call("GET", "k0") == value
        assert srv.strings.used <= 64 * KiB
    assert srv.strings.used == sum(_cost(k.decode(), value) for k in srv.keyspace.keys(b"*"))
    assert c.call("GET", "k1") is None and c.call("GET", "k39") == value
    assert srv.strings.evicted_keys == 40 - len(srv.keyspace)
    assert f"evicted_keys:{srv.strings.evicted_keys}\r\n" in c.call("INFO", "stats").decode()
    c.call("CONFIG", "RESETSTAT")
    assert srv.strings.evicted_keys == 0
    info = c.call("INFO", "memory").decode()
    assert "maxmemory:65536\r\n" in info and "maxmemory_policy:allkeys-lru\r\n" in info
    assert f"used_memory_strings:{srv.strings.used}\r\n" in info


def test_noeviction_answers_redis_oom_and_recovers_after_del() -> None:
    srv, c = _fake(maxmemory="16KiB", maxmemory_policy="noeviction")
    value = b"v" * (5 * KiB)
    assert [c.call("SET", f"k{i}", value) for i in range(3)] == [OK] * 3
    assert err(c, "SET", "k3", value) == OOM
    assert c.call("GET", "k0") == value and len(srv.keyspace) == 3  # reads still work
    assert c.call("DEL", "k0") == 1
    assert c.call("SET", "k3", value) == OK
    assert srv.strings.evicted_keys == 0


@pytest.mark.parametrize("policy", ["volatile-lru", "volatile-random", "volatile-ttl"])
def test_volatile_policies_evict_only_keys_with_a_ttl(policy: str) -> None:
    """Keys without a TTL are never evicted; with none left that has one, writes get -OOM."""
    srv, c = _fake(maxmemory="32KiB", maxmemory_policy=policy)
    value = b"v" * (4 * KiB)
    for i in range(3):
        assert c.call("SET", f"keep{i}", value) == OK
    for i in range(20):
        assert c.call("SET", f"ttl{i}", value, "EX", str(100 + i)) == OK
        assert srv.strings.used <= 32 * KiB
    assert all(c.call("GET", f"keep{i}") == value for i in range(3))
    assert srv.strings.evicted_keys > 0
    for k in srv.keyspace.keys(b"ttl*"):
        assert c.call("DEL", k) == 1
    for i in range(4):
        c.call("SET", f"more{i}", value)
    assert err(c, "SET", "last", value * 2) == OOM


def test_allkeys_random_keeps_within_the_limit() -> None:
    srv, c = _fake(maxmemory="32KiB", maxmemory_policy="allkeys-random")
    rng = random.Random(7)
    for i in range(200):
        assert c.call("SET", f"k{i}", b"r" * rng.randrange(1, 8 * KiB)) == OK
        assert srv.strings.used <= 32 * KiB
    assert srv.strings.evicted_keys > 100


def test_config_get_and_set_maxmemory() -> None:
    srv, c = _fake()
    assert c.call("CONFIG", "GET", "maxmemory*") == {
        "maxmemory": "0",
        "maxmemory-policy": "allkeys-lru",
    }
    # 0 means the DRAM tier's size; INFO shows what is enforced
    assert f"maxmemory:{srv.config.get('dram-capacity')}\r\n" in c.call("INFO").decode()
    assert c.call("CONFIG", "SET", "maxmemory", "1mb", "maxmemory-policy", "volatile-ttl") == OK
    assert srv.strings.limit == 1000**2 and srv.strings.policy == "volatile-ttl"
    assert "maxmemory-policy" in err(c, "CONFIG", "SET", "maxmemory-policy", "lfu-ish")


def test_expiry_and_flush_release_the_count() -> None:
    srv, c = _fake()
    c.call("SET", "a", b"1" * 100, "PX", "1")
    c.call("SET", "b", b"2" * 100)
    deadline = time.monotonic() + 5
    while srv.keyspace.peek(b"a") is not None and time.monotonic() < deadline:
        srv.keyspace.expire_cycle()
    assert srv.keyspace.peek(b"a") is None
    assert srv.strings.used == _cost("b", b"2" * 100)
    c.call("FLUSHALL")
    assert srv.strings.used == 0


# -- large values in the tiers, through a real server ----------------------------------------


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * KiB
    raise AssertionError("no VmRSS")


def test_forty_8mib_sets_keep_the_server_process_under_maxmemory(make_process_server) -> None:
    """The issue's case: 40 x 8 MiB SETs with maxmemory 128 MiB. Before, every value stayed
    in the Python heap (RSS +320 MiB); now they go to the tiers (a 32 MiB arena over NVMe),
    the server process grows by less than maxmemory, and an early value is still readable."""
    srv: RunningServer = make_process_server(
        maxmemory="128MiB", dram_capacity="32MiB", nvme_capacity="512MiB"
    )
    assert srv.process is not None
    r = redis.Redis(port=srv.port)
    r.set("warm", b"w" * MiB)  # first large value: buffers and pools are set up
    before = _rss(srv.process.pid)
    values = [random.Random(i).randbytes(8 * MiB) for i in range(3)]
    peak = before
    for i in range(40):
        assert r.set(f"lmcache:key{i}", values[i % 3])
        peak = max(peak, _rss(srv.process.pid))
    info = r.info("memory")
    assert peak - before < 128 * MiB, (before, peak)
    assert info["used_memory_strings"] <= info["maxmemory"] == 128 * MiB
    assert r.get("lmcache:key0") == values[0]  # read back through NVMe
    assert r.get("lmcache:key39") == values[0]
    r.close()


def test_large_value_lives_in_the_arena_and_leaves_with_its_key(make_server) -> None:
    srv = make_server(dram_capacity="16MiB", nvme_capacity="64MiB")
    r = redis.Redis(port=srv.port)
    value = random.Random(1).randbytes(3 * MiB + 5)
    assert r.set("big", value) and r.get("big") == value
    assert r.strlen("big") == len(value) and r.type("big") == b"string"
    assert r.keys("*") == [b"big"]  # the value's chunk is not a key of its own
    assert r.info("tiers")["dram_bytes"] >= len(value)
    used = r.info("tiers")["dram_used"]
    assert r.set("big", value[::-1], nx=True) is None  # received into a slot, then refused:
    assert r.info("tiers")["dram_used"] == used  # the slot was given back
    assert r.set("big", b"small now") and r.get("big") == b"small now"
    assert r.set("big2", value, px=50)
    deadline = time.monotonic() + 10
    while r.info("tiers")["dram_bytes"] and time.monotonic() < deadline:
        time.sleep(0.02)  # polling the condition: the arena copies are freed in background
    assert r.info("tiers")["dram_bytes"] == 0
    r.close()


def test_large_values_demote_to_nvme_and_read_back(make_server) -> None:
    """Scenario: 24 x 1 MiB values into an 8 MiB arena: most are demoted to NVMe by the
    tiers' LRU; every one reads back intact."""
    srv = make_server(dram_capacity="8MiB", nvme_capacity="64MiB")
    r = redis.Redis(port=srv.port)
    values = {f"v{i}": random.Random(i).randbytes(MiB) for i in range(24)}
    for k, v in values.items():
        assert r.set(k, v)
    tiers = r.info("tiers")
    assert tiers["nvme_bytes"] >= 16 * MiB
    for k, v in values.items():
        assert r.get(k) == v
    r.close()


def test_set_get_option_over_a_large_value(make_server) -> None:
    srv = make_server()
    r = redis.Redis(port=srv.port)
    old = b"o" * (100 * KiB)
    r.set("k", old)
    assert r.set("k", b"new", get=True) == old
    assert r.get("k") == b"new"
    r.close()


def test_large_values_are_not_kept_across_restarts(make_process_server, tmp_path: Path) -> None:
    data = tmp_path / "restart"
    srv = make_process_server(data_dir=data)
    r = redis.Redis(port=srv.port)
    r.set("big", b"b" * MiB)
    r.shutdown(nosave=True)
    assert srv.process is not None and srv.process.wait(30) is not None
    srv2 = make_process_server(data_dir=data)
    r2 = redis.Redis(port=srv2.port)
    assert r2.dbsize() == 0 and r2.keys("*") == []
    r2.close()
