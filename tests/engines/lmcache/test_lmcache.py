"""LMCache 0.5.6 against kvstrata (a ``kvstrata serve`` subprocess on loopback), through
LMCache's own ``RemoteBackend``: the built-in ``RedisConnector`` with no code of ours, and the
``KvstrataConnector`` plugin loaded through ``remote_storage_plugins``."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import torch

from kvstrata.clients.adapters import key_hash
from kvstrata.clients.lmcache import KvstrataConnector
from tests.conftest import RunningServer
from tests.engines.lmcache.harness import Stack, make_stack, plugin_extra

MakeStack = Callable[..., Stack]


@pytest.fixture
def kv(make_process_server: Callable[..., RunningServer]) -> RunningServer:
    return make_process_server(dram_capacity="64MiB")


@pytest.fixture
def stacks() -> Iterator[MakeStack]:
    made: list[Stack] = []

    def make(**kwargs: Any) -> Stack:
        stack = make_stack(**kwargs)
        made.append(stack)
        return stack

    yield make
    for s in made:
        s.close()


def plugin_stack(stacks: MakeStack, kv: RunningServer, **options: Any) -> Stack:
    return stacks(extra=plugin_extra(f"redis://127.0.0.1:{kv.port}", **options))


def same(a: Any, b: Any) -> bool:
    return (
        a.get_shapes() == b.get_shapes()
        and a.get_dtypes() == b.get_dtypes()
        and a.get_memory_format() == b.get_memory_format()
        and torch.equal(a.tensor, b.tensor)
    )


def copies(stack: Stack, objs: list[Any]) -> list[torch.Tensor]:
    """Clones of the data (LMCache frees a memory object once it is written)."""
    return [o.tensor.clone() for o in objs]


# -- the route with no code: LMCache's RedisConnector, remote_url redis://kvstrata --------------


def test_redis_connector_round_trip_against_kvstrata(stacks: MakeStack, kv: RunningServer) -> None:
    s = stacks(remote_url=f"redis://127.0.0.1:{kv.port}")
    assert type(s.backend.connection._connector).__name__ == "RedisConnector"  # type: ignore[union-attr]
    keys = [s.key(h) for h in (101, 102, 103)]
    objs = [s.chunk(seed=i) for i in range(3)]
    data = copies(s, objs)
    s.put(keys, objs)
    assert s.backend.contains(keys[0])
    assert s.backend.batched_contains([*keys, s.key(999)]) == 3
    for k, d in zip(keys, data, strict=True):
        got = s.backend.get_blocking(k)
        assert got is not None and torch.equal(got.tensor, d)
        got.ref_count_down()
    assert s.backend.get_blocking(s.key(999)) is None
    # what the route stores: two plain keys per chunk (bytes, then metadata)
    r = redis.Redis(port=kv.port)
    names = sorted(r.scan_iter(match="*Llama*"))
    assert len(names) == 6 and all(n.endswith((b"kv_bytes", b"metadata")) for n in names)


# -- the plugin ---------------------------------------------------------------------------------


def test_plugin_is_built_by_lmcache_plugin_loading(stacks: MakeStack, kv: RunningServer) -> None:
    s = plugin_stack(stacks, kv)
    conn = s.backend.connection
    assert conn is not None and type(conn._connector) is KvstrataConnector  # type: ignore[attr-defined]
    assert s.run(conn.ping()) == 0


def test_plugin_round_trip_one_chunk_per_chunk(stacks: MakeStack, kv: RunningServer) -> None:
    s = plugin_stack(stacks, kv)
    keys = [s.key(h) for h in (1, 2, 3, 4)]
    objs = [s.chunk(seed=i) for i in range(3)] + [s.chunk(tokens=5, seed=3)]  # last one partial
    data = copies(s, objs)
    shapes = [o.get_shapes() for o in objs]
    s.put(keys, objs)
    got = s.backend.batched_get_blocking(keys)
    for g, d, shape in zip(got, data, shapes, strict=True):
        assert g is not None and g.get_shapes() == shape and g.get_dtypes() == [torch.float16]
        assert torch.equal(g.tensor, d)
        g.ref_count_down()
    # one kvstrata chunk per LMCache chunk, each linked to the chunk before it
    conn = s.backend.connection._connector  # type: ignore[union-attr]
    ns = conn.namespace(keys[0])
    r = redis.Redis(port=kv.port)
    assert len(list(r.scan_iter(match=f"kv:{ns}:*"))) == 4
    info = r.execute_command("KV.INFO", ns, key_hash(keys[2].to_string()))
    info = dict(zip(info[::2], info[1::2], strict=True)) if isinstance(info, list) else info
    assert info[b"parent"] in (
        key_hash(keys[1].to_string()),
        key_hash(keys[1].to_string()).hex().encode(),
    )


def test_plugin_round_trip_over_tcp(stacks: MakeStack, kv: RunningServer) -> None:
    s = plugin_stack(stacks, kv, zero_copy=False)
    keys = [s.key(h) for h in (11, 12)]
    objs = [s.chunk(seed=i) for i in range(2)]
    data = copies(s, objs)
    s.put(keys, objs)
    for k, d in zip(keys, data, strict=True):
        got = s.backend.get_blocking(k)
        assert got is not None and torch.equal(got.tensor, d)
        got.ref_count_down()


def test_plugin_exists_is_a_leading_prefix(stacks: MakeStack, kv: RunningServer) -> None:
    s = plugin_stack(stacks, kv)
    keys = [s.key(h) for h in range(20, 26)]
    s.put(keys[:3], [s.chunk(seed=i) for i in range(3)])
    s.put(keys[4:5], [s.chunk(seed=4)])
    assert s.backend.batched_contains(keys) == 3
    assert s.run(s.backend.batched_async_contains("lookup", keys)) == 3
    assert s.backend.batched_contains(keys[3:]) == 0
    assert s.backend.contains(keys[4]) and not s.backend.contains(keys[3])
    conn = s.backend.connection
    assert conn is not None and conn.exists_sync(keys[0]) and not conn.exists_sync(keys[3])


def test_plugin_exists_sync_from_other_threads_while_the_loop_writes(
    stacks: MakeStack, kv: RunningServer
) -> None:
    s = plugin_stack(stacks, kv)
    conn = s.backend.connection
    assert conn is not None
    keys = [s.key(h) for h in range(100, 140)]
    errors: list[BaseException] = []

    def ask() -> None:
        try:
            for k in keys:
                conn.exists_sync(k)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    s.put(keys, [s.chunk(seed=i) for i in range(len(keys))])
    for t in threads:
        t.join()
    assert errors == []
    assert all(conn.exists_sync(k) for k in keys)


def test_plugin_misses(stacks: MakeStack, kv: RunningServer) -> None:
    s = plugin_stack(stacks, kv)
    stored = s.key(7)
    s.put([stored], [s.chunk()])
    assert s.backend.get_blocking(s.key(8)) is None
    assert not s.backend.contains(s.key(8))
    assert s.backend.get_blocking(s.key(7, worker=1)) is None  # another worker's namespace
    got = s.backend.batched_get_blocking([stored, s.key(8)])
    assert got[0] is not None and got[1] is None
    got[0].ref_count_down()
    conn = s.backend.connection
    assert conn is not None
    assert s.run(conn.batched_get_non_blocking("lookup", [s.key(8), stored])) == []


def test_plugin_without_url_is_refused(stacks: MakeStack, kv: RunningServer) -> None:
    extra = plugin_extra("")
    s = stacks(extra=extra)
    assert s.backend.connection is None  # LMCache logs the connector's ValueError


def test_plugin_server_down_is_a_miss(stacks: MakeStack, kv: RunningServer) -> None:
    s = plugin_stack(stacks, kv)
    key = s.key(30)
    s.put([key], [s.chunk()])
    kv.stop()
    assert not s.backend.contains(key)  # LMCache turns the connector's error into a miss
    assert s.backend.batched_contains([key]) == 0
    assert s.backend.get_blocking(key) is None


def test_plugin_with_a_server_on_another_host_falls_back_to_tcp(
    stacks: MakeStack, kv: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The arena cannot be mapped (the server runs elsewhere): chunks still move, over TCP."""
    from kvstrata.clients import handles

    def unmappable(region: Any) -> memoryview:
        raise handles.RegionMapError(f"{region.name}: not on this host")

    s = plugin_stack(stacks, kv)
    monkeypatch.setattr(handles, "map_shm", unmappable)
    conn = s.backend.connection._connector  # type: ignore[union-attr]
    keys = [s.key(h) for h in (40, 41)]
    objs = [s.chunk(seed=i) for i in range(2)]
    data = copies(s, objs)
    s.put(keys, objs)
    assert conn.zero_copy is False
    conn.zero_copy = True  # the read side finds out on its own
    got = s.backend.batched_get_blocking(keys)
    for g, d in zip(got, data, strict=True):
        assert g is not None and torch.equal(g.tensor, d)
        g.ref_count_down()
    assert conn.zero_copy is False
