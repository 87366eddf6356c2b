"""kvstrata as SGLang 0.5.23's HiCache L3 storage, built through SGLang's own backend factory
(``--hicache-storage-backend dynamic``) against a ``kvstrata serve`` subprocess on loopback."""

from __future__ import annotations

import hashlib
import socket
import threading
from collections.abc import Callable
from typing import Any

import pytest
import redis
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.storage import StorageBackendFactory

from kvstrata.clients.adapters import key_hash
from kvstrata.clients.sglang import KvstrataHiCacheStorage
from tests.conftest import RunningServer
from tests.engines.sglang.hostpool import LayerFirstHostPool, PageFirstHostPool

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def storage_config(url: str, tp_rank: int = 0, **extra: Any) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=2,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=True,
        is_page_first_layout=True,
        model_name=MODEL,
        extra_config={
            "backend_name": "kvstrata",
            "module_path": "kvstrata.clients.sglang",
            "class_name": "KvstrataHiCacheStorage",
            "url": url,
            "interface_v1": 1,
            **extra,
        },
    )


def page_keys(n: int, seed: str = "p") -> list[str]:
    """Page keys as HiCache makes them: a chain of hex SHA-256 digests."""
    out, prev = [], seed.encode()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).hexdigest().encode()
        out.append(prev.decode())
    return out


@pytest.fixture
def kv(make_process_server: Callable[..., RunningServer]) -> RunningServer:
    return make_process_server(dram_capacity="64MiB")


Build = Callable[..., tuple[KvstrataHiCacheStorage, PageFirstHostPool]]


@pytest.fixture
def build(kv: RunningServer) -> Build:
    def make(
        pages: int = 16, tp_rank: int = 0, pool_cls: type = PageFirstHostPool, **extra: Any
    ) -> Any:
        cfg = storage_config(f"redis://127.0.0.1:{kv.port}", tp_rank, **extra)
        pool = pool_cls(pages)
        backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
        backend.register_mem_pool_host(pool)  # as HiCacheController.attach_storage_backend does
        return backend, pool

    return make


def fill(pool: PageFirstHostPool) -> None:
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).to(pool.dtype))


def test_factory_loads_the_backend_with_a_namespace_of_the_layout(build: Build) -> None:
    backend, _ = build()
    assert type(backend) is KvstrataHiCacheStorage
    want = "sglang@meta-llama-Llama-3.1-8B-Instruct@tp2r0@bfloat16@p4@l3@page_first"
    assert backend.namespace == want
    other, _ = build(tp_rank=1)
    assert other.namespace.replace("tp2r1", "tp2r0") == backend.namespace


def test_zero_copy_round_trip_through_the_host_pool(build: Build, kv: RunningServer) -> None:
    backend, pool = build()
    fill(pool)
    keys = page_keys(4)
    original = pool.kv_buffer[:, : 4 * pool.page_size].clone()
    extra = HiCacheStorageExtraInfo(prefix_keys=["before"])
    assert backend.batch_set_v1(keys, pool.page_indices(0, 4), extra) == [True] * 4
    # the chain is linked, the first page to the last prefix key
    r = redis.Redis(port=kv.port)
    info = r.execute_command("KV.INFO", backend.namespace, key_hash(keys[2]))
    info = dict(zip(info[::2], info[1::2], strict=True)) if isinstance(info, list) else info
    assert info[b"parent"] in (key_hash(keys[1]), key_hash(keys[1]).hex().encode())
    assert backend.batch_exists(keys) == 4
    # load into other pages of the pool: the bytes come back
    assert backend.batch_get_v1(keys, pool.page_indices(8, 4)) == [True] * 4
    assert torch.equal(pool.kv_buffer[:, 8 * pool.page_size : 12 * pool.page_size], original)
    # storing again is a success without a second copy
    assert backend.batch_set_v1(keys, pool.page_indices(0, 4)) == [True] * 4
    stats = backend.get_stats()
    assert stats.backup_pgs == [4, 4] and stats.prefetch_pgs == [4] and stats.errors == 0
    assert backend.get_stats().backup_pgs == []  # counters restart


def test_round_trip_over_tcp_without_the_arena(build: Build) -> None:
    backend, pool = build(zero_copy=False)
    fill(pool)
    keys = page_keys(3, "tcp")
    assert backend.batch_set_v1(keys, pool.page_indices(0, 3)) == [True] * 3
    expect = pool.kv_buffer[:, : 3 * pool.page_size].clone()
    assert backend.batch_get_v1(keys, pool.page_indices(5, 3)) == [True] * 3
    assert torch.equal(pool.kv_buffer[:, 5 * pool.page_size : 8 * pool.page_size], expect)


def test_generic_get_set_round_trip(build: Build) -> None:
    backend, pool = build(interface_v1=0)
    fill(pool)
    keys = page_keys(3, "generic")
    pages = [pool.get_data_page(i * pool.page_size) for i in range(3)]
    assert backend.batch_set(keys, pages)
    got = backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    for page, g in zip(pages, got, strict=True):
        assert g is not None and torch.equal(g, page)
    one = backend.get(keys[1], pool.get_dummy_flat_data_page())
    assert one is not None and torch.equal(one, pages[1])
    assert backend.set("single", pages[0]) and backend.exists("single")


@pytest.mark.parametrize("pool_cls", [PageFirstHostPool, LayerFirstHostPool])
@pytest.mark.parametrize("zero_copy", [True, False])
def test_v1_and_generic_servers_read_each_others_pages(
    build: Build, pool_cls: type, zero_copy: bool
) -> None:
    """Two SGLang servers sharing kvstrata, one on the zero-copy v1 interface, one on the
    generic one (``interface_v1`` 0), share a namespace: a page either stores must read back
    as the same KV through the other. For ``layer_first`` SGLang's v1 buffers of a page are
    K0 V0 K1 V1 … while its flat data page is K0 K1 … V0 V1 …: stored in v1 order, the generic
    server read every page with K and V of different layers swapped, silently."""
    v1, src = build(pool_cls=pool_cls, zero_copy=zero_copy)
    generic, dst = build(pool_cls=pool_cls, interface_v1=0, zero_copy=zero_copy)
    assert v1.namespace == generic.namespace
    fill(src)
    n, ps = 3, src.page_size
    keys = page_keys(n, f"mixed-{pool_cls.layout}-{zero_copy}")
    assert v1.batch_set_v1(keys, src.page_indices(0, n)) == [True] * n
    got = generic.batch_get(keys, [dst.get_dummy_flat_data_page() for _ in keys])
    for i, page in enumerate(got):
        assert page is not None
        dst.set_from_flat_data_page(i * ps, page)
        assert torch.equal(dst.get_data_page(i * ps), src.get_data_page(i * ps))
    # and the other way: the generic server's pages loaded by the v1 one
    fill(dst)
    back = page_keys(n, f"back-{pool_cls.layout}-{zero_copy}")
    assert generic.batch_set(back, [dst.get_data_page(i * ps) for i in range(n)])
    assert v1.batch_get_v1(back, src.page_indices(5, n)) == [True] * n
    for i in range(n):
        assert torch.equal(src.get_data_page((5 + i) * ps), dst.get_data_page(i * ps))


def test_batch_exists_counts_leading_hits_only(build: Build) -> None:
    backend, pool = build()
    keys = page_keys(6, "exists")
    backend.batch_set_v1(keys[:3], pool.page_indices(0, 3))
    backend.batch_set_v1(keys[4:5], pool.page_indices(4, 1))  # a hole at 3, then a hit
    assert backend.batch_exists(keys) == 3
    assert backend.batch_exists(keys[3:]) == 0
    assert backend.batch_exists(keys[4:]) == 1
    assert backend.batch_exists([]) == 0
    assert backend.exists(keys[0]) and not backend.exists(keys[3])


def test_misses_leave_the_pool_untouched(build: Build) -> None:
    backend, pool = build()
    keys = page_keys(3, "miss")
    backend.batch_set_v1(keys[:1], pool.page_indices(0, 1))
    fill(pool)
    before = pool.kv_buffer.clone()
    assert backend.batch_get_v1(page_keys(2, "absent"), pool.page_indices(4, 2)) == [False] * 2
    assert torch.equal(pool.kv_buffer, before)
    assert backend.batch_get_v1(keys, pool.page_indices(4, 3)) == [True, False, False]
    assert backend.get("absent", pool.get_dummy_flat_data_page()) is None
    assert backend.batch_get(["absent", keys[0]], None)[0] is None


def test_long_pool_suffixed_keys_and_namespaces_apart(build: Build) -> None:
    backend, pool = build()
    other_rank, _ = build(tp_rank=1)
    key = page_keys(1)[0] + ".mamba" + "x" * 40  # > 64 bytes
    assert backend.batch_set_v1([key], pool.page_indices(0, 1)) == [True]
    assert backend.exists(key)
    assert not other_rank.exists(key)


def test_clear_deletes_only_this_namespace(build: Build) -> None:
    backend, pool = build()
    other_rank, _ = build(tp_rank=1)
    keys = page_keys(2, "clear")
    backend.batch_set_v1(keys, pool.page_indices(0, 2))
    other_rank.batch_set_v1(keys, pool.page_indices(0, 2))
    assert backend.clear() is True
    assert backend.batch_exists(keys) == 0
    assert other_rank.batch_exists(keys) == 2


def test_prefetch_and_backup_threads_at_once(build: Build) -> None:
    backend, pool = build(pages=64)
    fill(pool)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            keys = page_keys(4, f"thread{t}")
            for _ in range(5):
                assert backend.batch_set_v1(keys, pool.page_indices(t * 4, 4)) == [True] * 4
                assert backend.batch_exists(keys) == 4
                assert backend.batch_get_v1(keys, pool.page_indices(32 + t * 4, 4)) == [True] * 4
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    ps = pool.page_size
    assert torch.equal(pool.kv_buffer[:, 32 * ps : 56 * ps], pool.kv_buffer[:, : 24 * ps])


def test_server_down(build: Build, kv: RunningServer) -> None:
    backend, pool = build()
    keys = page_keys(2, "down")
    assert backend.batch_set_v1(keys, pool.page_indices(0, 2)) == [True, True]
    kv.stop()
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, pool.page_indices(2, 2)) == [False, False]
    assert backend.batch_set_v1(keys, pool.page_indices(0, 2)) == [False, False]
    assert backend.get(keys[0], pool.get_dummy_flat_data_page()) is None
    assert backend.batch_set(keys, [pool.get_data_page(0)] * 2) is False
    assert backend.get_stats().errors == 5


def test_unreachable_server_fails_at_attach() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        cfg = storage_config(f"redis://127.0.0.1:{port}")
        with pytest.raises(ConnectionError, match="cannot reach"):
            StorageBackendFactory.create_backend("dynamic", cfg, None)


def test_missing_url_is_a_clear_error() -> None:
    cfg = storage_config("")
    with pytest.raises(ValueError, match='needs "url"'):
        StorageBackendFactory.create_backend("dynamic", cfg, None)


def test_a_server_on_another_host_falls_back_to_tcp(
    build: Build, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The arena cannot be mapped (the server runs elsewhere): pages still move, over TCP."""
    from kvstrata.clients import handles

    def unmappable(region: Any) -> memoryview:
        raise handles.RegionMapError(f"{region.name}: not on this host")

    backend, pool = build()
    fill(pool)
    monkeypatch.setattr(handles, "map_shm", unmappable)
    keys = page_keys(3, "remote")
    assert backend.batch_set_v1(keys, pool.page_indices(0, 3)) == [True] * 3
    assert backend.zero_copy is False
    backend.zero_copy = True  # the read side finds out on its own
    expect = pool.kv_buffer[:, : 3 * pool.page_size].clone()
    assert backend.batch_get_v1(keys, pool.page_indices(4, 3)) == [True] * 3
    assert torch.equal(pool.kv_buffer[:, 4 * pool.page_size : 7 * pool.page_size], expect)
    assert backend.zero_copy is False and backend.get_stats().errors == 0
