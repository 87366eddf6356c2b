"""``KvstrataOffloadingSpec`` at its plug-in point, on CPU: the kvstrata tier it adds, and its host
worker's block copies between a CPU "device" KV cache and the shared offload region, checked
byte for byte against the rows the scheduler side (the primary tier kvstrata reads) sees."""

from __future__ import annotations

import dataclasses
import uuid

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor
from vllm.v1.kv_offload.base import GPULoadStoreSpec as DeviceSpec
from vllm.v1.kv_offload.config import OffloadingCacheConfig
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvstrata.clients.vllm import KvstrataOffloadingSpec, KvstrataTier
from kvstrata.clients.vllm_spec import HostOffloadingWorker, with_kvstrata
from tests.engines.vllm.harness import offloading_config

PAGES = (4096, 8192)  # two layer tensors of different page sizes
BLOCKS = 12


def make_spec(port: int, blocks_per_chunk: int, **extra: object) -> KvstrataOffloadingSpec:
    config = dataclasses.replace(
        offloading_config(engine_id=f"kvstrata-test-{uuid.uuid4().hex[:12]}"),
        worker_kv_bytes_per_block=sum(PAGES),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
        extra_config={"cpu_bytes_to_use": 8 * sum(PAGES) * blocks_per_chunk,
                      "kvstrata": {"url": f"redis://127.0.0.1:{port}"}, **extra},
    )  # fmt: skip
    return KvstrataOffloadingSpec(config)


def device_caches(seed: int) -> tuple[list[torch.Tensor], CanonicalKVCaches]:
    gen = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randint(-128, 128, (BLOCKS, p), dtype=torch.int8, generator=gen) for p in PAGES
    ]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, t.shape[1]) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(i, p) for i, p in enumerate(PAGES)]],
    )
    return tensors, caches


def host_rows(spec: KvstrataOffloadingSpec) -> np.ndarray:
    """The primary tier's rows as the scheduler side (and so kvstrata) sees them."""
    view = spec.get_manager().primary_tier.get_kv_memoryview()
    return np.asarray(view).reshape(spec.num_chunks, -1).view(np.int8)


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_host_worker_copies_blocks_both_ways(server, blocks_per_chunk) -> None:
    """Scenario: device blocks 3, 5, 6 (group starting at logical block 1, so with 2 blocks per
    chunk the first chunk's first half is skipped) are stored into chunks 0, 1; the scheduler's
    rows then hold exactly those bytes, layer tensor after layer tensor; loading the chunks back
    into other device blocks restores the same bytes."""
    spec = make_spec(server.port, blocks_per_chunk)
    try:
        assert isinstance(spec.get_manager().secondary_tiers[0], KvstrataTier)
        tensors, caches = device_caches(seed=blocks_per_chunk)
        worker = spec.get_worker(caches)
        assert isinstance(worker, HostOffloadingWorker)
        src = [3, 5, 6] if blocks_per_chunk == 2 else [3, 5]
        chunks = [0, 1]
        start = 1 if blocks_per_chunk == 2 else 0
        store = DeviceSpec(src, [len(src)], [start])
        assert worker.submit_store(7, store, CPULoadStoreSpec(chunks))
        (result,) = worker.get_finished()
        assert (result.job_id, result.success) == (7, True)
        assert result.transfer_size == len(src) * sum(PAGES)

        rows = host_rows(spec)
        for t_idx, page in enumerate(PAGES):
            offset = sum(PAGES[:t_idx]) * blocks_per_chunk  # each tensor's slice of a row
            slots = [(c, j) for c in chunks for j in range(blocks_per_chunk)][start:]
            for block, (chunk, j) in zip(src, slots, strict=True):
                cell = rows[chunk, offset + j * page : offset + (j + 1) * page]
                assert cell.tobytes() == tensors[t_idx][block].numpy().tobytes()

        dst = [9, 10, 11] if blocks_per_chunk == 2 else [9, 10]
        before = [t.clone() for t in tensors]
        assert worker.submit_load(8, CPULoadStoreSpec(chunks), DeviceSpec(dst, [len(dst)], [start]))
        assert [r.job_id for r in worker.get_finished()] == [8]
        for t_idx in range(len(PAGES)):
            for s, d in zip(src, dst, strict=True):
                assert torch.equal(tensors[t_idx][d], before[t_idx][s])
            untouched = [b for b in range(BLOCKS) if b not in dst]
            assert torch.equal(tensors[t_idx][untouched], before[t_idx][untouched])
        worker.wait({7, 8})
    finally:
        spec.get_manager().shutdown()
        if spec._worker is not None:
            spec._worker.shutdown()


def test_block_ids_outside_the_cache_are_refused(server) -> None:
    spec = make_spec(server.port, 1)
    try:
        _, caches = device_caches(seed=0)
        worker = spec.get_worker(caches)
        with pytest.raises(IndexError):
            worker.submit_store(1, DeviceSpec([BLOCKS], [1], [0]), CPULoadStoreSpec([0]))
        with pytest.raises(IndexError):
            worker.submit_load(2, CPULoadStoreSpec([spec.num_chunks]), DeviceSpec([0], [1], [0]))
        assert worker.get_finished() == []
    finally:
        spec.get_manager().shutdown()
        spec._worker.shutdown()


def test_kvstrata_tier_is_added_once_or_left_out() -> None:
    fs = {"type": "fs", "root_dir": "/x"}
    assert with_kvstrata({"cpu_bytes_to_use": 1})["secondary_tiers"] == [
        {"type": "KvstrataTier", "module_path": "kvstrata.clients.vllm",
         "url": "redis://127.0.0.1:7379"}
    ]  # fmt: skip
    got = with_kvstrata({"secondary_tiers": [fs], "kvstrata": {"url": "redis://h:1"}})
    assert got["secondary_tiers"][0] == fs and got["secondary_tiers"][1]["url"] == "redis://h:1"
    assert "kvstrata" not in got
    assert with_kvstrata({"kvstrata": False, "secondary_tiers": [fs]})["secondary_tiers"] == [fs]
    listed = {"type": "KvstrataTier", "module_path": "kvstrata.clients.vllm", "url": "redis://a:1"}
    assert with_kvstrata({"secondary_tiers": [listed]})["secondary_tiers"] == [listed]
    with pytest.raises(ValueError, match="kvstrata must be"):
        with_kvstrata({"kvstrata": "redis://h:1"})


def test_without_kvstrata_the_spec_is_vllms_cpu_tier(server) -> None:
    spec = make_spec(server.port, 1, kvstrata=False)
    try:
        assert spec.get_manager().secondary_tiers == []
    finally:
        spec.get_manager().shutdown()
