"""Helpers of the vLLM tier tests: a real ``OffloadingSpec``/``OffloadingConfig`` over a numpy
primary buffer, the tier built by vLLM's ``SecondaryTierFactory``, and polling helpers that wait
on conditions with a deadline (never a bare sleep)."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingSpec,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

ROWS = 16
ROW_BYTES = 64 * 1024
TOKENS_PER_BLOCK = 16
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def offloading_config(
    model: str = "kvstrata-test/tiny-llama",
    dtype: str = "float16",
    tp: int = 1,
    engine_id: str = "engine-a",
) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(TOKENS_PER_BLOCK, ("layers.0", "layers.1"), 0),),
        worker_kv_bytes_per_block=ROW_BYTES // tp,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id=engine_id,
        model=model_config(name=model, dtype=dtype, max_model_len=4096),
        cache=OffloadingCacheConfig(tokens_per_hash=TOKENS_PER_BLOCK, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=tp,
            tp_size=tp,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


def model_config(**fields: Any) -> OffloadingModelConfig:
    """vLLM's ``OffloadingModelConfig`` from the fields this vLLM has (0.32 has no
    ``max_model_len``)."""
    known = {f.name for f in dataclasses.fields(OffloadingModelConfig)}
    return OffloadingModelConfig(**{k: v for k, v in fields.items() if k in known})


class SpecForTier(OffloadingSpec):
    """A real OffloadingSpec (config, blocks_per_chunk, tokens_per_hash) for a lone tier."""

    def get_manager(self) -> Any:
        raise NotImplementedError

    def get_worker(self, kv_caches: Any) -> Any:
        raise NotImplementedError


class Instance:
    """One "vLLM instance": a primary buffer and the kvstrata tier over it."""

    def __init__(self, port: int, config: OffloadingConfig | None = None, **opts: Any) -> None:
        self.buffer = np.zeros((ROWS, ROW_BYTES), dtype=np.int8)
        tier_config = {
            "type": "KvstrataTier",
            "module_path": "kvstrata.clients.vllm",
            "url": f"redis://127.0.0.1:{port}",
            **opts,
        }
        spec = SpecForTier(config or offloading_config())
        self.tier = SecondaryTierFactory.create_secondary_tier(
            tier_config, memoryview(self.buffer), spec
        )
        self.next_job = 0
        self.results: dict[int, JobResult] = {}

    def fill(self, rows: Sequence[int], seed: int) -> None:
        rng = np.random.default_rng(seed)
        for r in rows:
            self.buffer[r] = rng.integers(-128, 128, ROW_BYTES, dtype=np.int8)

    def job(self, keys: Sequence[OffloadKey], rows: Sequence[int], ctx: ReqContext,
            promotion: bool) -> TransferJob:  # fmt: skip
        self.next_job += 1
        for i, k in enumerate(keys):
            ctx.set_offload_key_position(k, (i + 1) * TOKENS_PER_BLOCK)
        return TransferJob(
            job_id=self.next_job,
            keys=list(keys),
            chunk_ids=np.array(rows, dtype=np.int32),
            is_promotion=promotion,
            req_context=ctx,
        )

    def store(self, keys: Sequence[OffloadKey], rows: Sequence[int], ctx: ReqContext) -> int:
        job = self.job(keys, rows, ctx, promotion=False)
        self.tier.submit_store(job)
        return job.job_id

    def load(self, keys: Sequence[OffloadKey], rows: Sequence[int], ctx: ReqContext) -> int:
        job = self.job(keys, rows, ctx, promotion=True)
        self.tier.submit_load(job)
        return job.job_id

    def wait(self, job_id: int, timeout: float = 30.0) -> JobResult:
        """Poll get_finished_jobs until ``job_id`` is reported; each id must come once."""
        deadline = time.monotonic() + timeout
        while job_id not in self.results:
            for result in self.tier.get_finished_jobs():
                assert result.job_id not in self.results, f"job {result.job_id} reported twice"
                self.results[result.job_id] = result
            if job_id in self.results:
                break
            assert time.monotonic() < deadline, f"job {job_id} never finished"
            time.sleep(0.005)
        return self.results[job_id]

    def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext,
               timeout: float = 30.0) -> list[LookupResult]:  # fmt: skip
        """The scheduler's pattern: scan the chain, end the step, scan again until no RETRY."""
        deadline = time.monotonic() + timeout
        while True:
            results = [self.tier.lookup(k, ctx) for k in keys]
            if LookupResult.RETRY not in results:
                return results
            self.tier.on_schedule_end(END)
            assert time.monotonic() < deadline, "lookups never resolved"
            time.sleep(0.005)


def chain_keys(n: int, salt: bytes = b"", group: int = 0) -> list[OffloadKey]:
    """Offload keys shaped like vLLM's: a 32-byte chained sha256 + the group index."""
    keys, h = [], hashlib.sha256(b"none" + salt).digest()
    for i in range(n):
        h = hashlib.sha256(h + i.to_bytes(4, "little")).digest()
        keys.append(make_offload_key(h, group))
    return keys
