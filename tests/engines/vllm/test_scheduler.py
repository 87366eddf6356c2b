"""vLLM's own ``Scheduler`` on CPU with ``OffloadingConnector`` + ``TieringOffloadingSpec`` and the
kvstrata tier, against a real ``kvstrata serve``. The model is a local folder holding only a
tiny ``config.json`` (no weights, no hub download): the scheduler needs the model's shape, and
this test plays the GPU worker (it "copies" GPU → CPU by writing the CPU rows a store job names,
and reports every transfer job done)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvstrata.clients import Client
from kvstrata.clients.vllm import KvstrataTier

BLOCK = 16
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float16",
}


def vllm_config(model_dir: Path, port: int, hash_algo: str = "sha256") -> VllmConfig:
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
    tier = {"type": "KvstrataTier", "module_path": "kvstrata.clients.vllm",
            "url": f"redis://127.0.0.1:{port}"}  # fmt: skip
    return VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir), skip_tokenizer_init=True, dtype="float16", max_model_len=512
        ),
        cache_config=CacheConfig(
            block_size=BLOCK, enable_prefix_caching=True, prefix_caching_hash_algo=hash_algo
        ),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=512, max_num_seqs=4, max_model_len=512, is_encoder_decoder=False
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "TieringOffloadingSpec",
                "cpu_bytes_to_use": 1 << 22,
                "secondary_tiers": [tier],
            },
        ),
        device_config=DeviceConfig(device="cpu"),
    )


def make_scheduler(config: VllmConfig) -> Scheduler:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float16)
    kv_cache = KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)]
    )
    config.cache_config.num_gpu_blocks = 64
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
        log_stats=True,
    )


class Engine:
    """The scheduler plus a stand-in for the GPU worker."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        connector: Any = scheduler.connector
        self.manager = connector.connector_scheduler.manager
        self.tier = self.manager.secondary_tiers[0]
        self.rows = np.asarray(self.manager.primary_tier.get_kv_memoryview()).view(np.uint8)
        self.rng = np.random.default_rng(0)
        self.stored_rows: list[bytes] = []  # what the "GPU → CPU" copies wrote
        self.loads: list[tuple[str, list[int]]] = []  # CPU → GPU: request, CPU rows
        self.started: dict[str, int] = {}  # request → tokens already computed when scheduled
        self.hasher = get_request_block_hasher(BLOCK, sha256)

    def add(self, req_id: str, prompt: list[int]) -> Request:
        params = SamplingParams(max_tokens=1)
        params.update_from_generation_config({}, None)
        req = Request(req_id, prompt, params, None, block_hasher=self.hasher)
        self.scheduler.add_request(req)
        return req

    def step(self) -> Any:
        out = self.scheduler.schedule()
        for new in out.scheduled_new_reqs:
            self.started[new.req_id] = new.num_computed_tokens
        meta = out.kv_connector_metadata
        assert isinstance(meta, OffloadingConnectorMetadata)
        done = {}
        for job_id, job in meta.store_jobs.items():  # GPU → CPU: write the CPU rows
            for row in job.dst_spec.chunk_ids:
                data = self.rng.integers(0, 256, self.rows.shape[1], dtype=np.uint8)
                self.rows[row] = data
                self.stored_rows.append(data.tobytes())
            done[job_id] = 1
        received = set()
        for job_id, job in meta.load_jobs.items():  # CPU → GPU: remember which rows
            self.loads.append((job.req_id, [int(r) for r in job.src_spec.chunk_ids]))
            done[job_id] = 1
            if not getattr(job, "sync", False):  # vLLM 0.32's load jobs are all async
                received.add(job.req_id)
        req_ids = [r.request_id for r in self.scheduler.running]
        runner = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[7] for _ in req_ids],
            kv_connector_output=KVConnectorOutput(
                finished_recving=received,
                kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=done),
            ),
        )
        self.scheduler.update_from_output(out, runner)
        return out

    def run_until(self, cond: Any, timeout: float = 30.0) -> None:
        """Step until ``cond()``. Each step also lets 2 ms pass, standing in for the forward
        pass during which a real engine's GIL is free for the tier's I/O threads."""
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, "the scheduler never got there"
            self.step()
            time.sleep(0.002)


def test_second_request_loads_its_prefix_from_kvstrata(server, tmp_path) -> None:
    """Scenario: request A (64 prompt tokens = 4 blocks) runs; vLLM offloads its blocks to its
    CPU tier, which cascades them to kvstrata. The GPU prefix cache and the CPU tier are then
    reset. Request B with the same prompt is scheduled with its prefix found in kvstrata,
    promoted into the CPU tier (exact bytes) and loaded from there instead of computed."""
    init_none_hash(sha256)
    engine = Engine(make_scheduler(vllm_config(tmp_path / "tiny", server.port)))
    assert isinstance(engine.tier, KvstrataTier)
    prompt = [(i * 37) % 1000 for i in range(4 * BLOCK)]
    a = engine.add("A", prompt)
    engine.run_until(lambda: a.status == RequestStatus.FINISHED_LENGTH_CAPPED)
    keys = [make_offload_key(h, 0) for h in a.block_hashes[:4]]
    ns = engine.tier.namespace
    with Client(port=server.port) as kv:
        engine.run_until(lambda: kv.match(ns, keys) == 4)  # the cascade to kvstrata landed
        cached = [bytes(p) for p in kv.mget(ns, keys)]
    assert set(cached) <= set(engine.stored_rows)  # the bytes A's "GPU" wrote to the CPU rows

    engine.run_until(lambda: not engine.manager.has_pending_work())
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    engine.add("B", prompt)
    engine.run_until(lambda: "B" in engine.started)
    # scheduled with the whole prompt loaded (vLLM recomputes only the last token)
    assert engine.started == {"A": 0, "B": len(prompt) - 1}
    assert engine.loads, "B's prefix was not loaded from the CPU tier"
    (req_id, rows), = engine.loads
    assert req_id == "B" and len(rows) == len(cached)
    for row, payload in zip(rows, cached, strict=True):
        assert engine.rows[row].tobytes() == payload
    engine.scheduler.shutdown()


def test_unshareable_hash_algo_is_refused_at_construction(server, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    config = vllm_config(tmp_path / "tiny", server.port, hash_algo="xxhash")
    with set_current_vllm_config(config), pytest.raises(ValueError, match="PYTHONHASHSEED"):
        make_scheduler(config)
