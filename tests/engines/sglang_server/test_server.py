"""SGLang 0.5.23's real server (``python -m sglang.launch_server``) on CPU, with HiCache and
kvstrata as its L3 storage (``--hicache-storage-backend dynamic``, SGLang's v1 zero-copy
interface on one server and its generic copying one on the other).

One kvstrata process and two SGLang servers (A: ``interface_v1``, B: generic path) are shared by
the scenarios, which run in file order: each asserts the greedy text, token ids and logprobs
against the first (recomputed) answer and how many prompt tokens came from L3
(``meta_info.cached_tokens_details.storage``). About 5 minutes on 2 loaded cores, most of it the
three SGLang start-ups (two together, one restart).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.conftest import RunningServer, free_port, start_process_server
from tests.engines.sglang_server.harness import (
    PAGE,
    Reply,
    SGLangServer,
    launch,
    reply,
    wait_until,
)
from tests.engines.sglang_server.tiny_model import words, write_model

pytestmark = pytest.mark.timeout(900)

#: Prompt tokens per scenario prompt; the part HiCache can store is the full pages.
PROMPT = 1000
STORED = PROMPT // PAGE * PAGE
#: Device pool tokens (host pool: twice that); the fillers add up to more than both.
DEVICE_TOKENS = 4096
FILLERS = 7


class Stack:
    """kvstrata and the SGLang servers under test, with the answers seen so far."""

    def __init__(self, workdir: Path, model: Path) -> None:
        self.workdir, self.model = workdir, model
        self.kv_port = free_port()
        self.kv: RunningServer = self.start_kv()
        self.servers: dict[str, SGLangServer] = {}
        self.first: dict[int, Reply] = {}

    @property
    def kv_url(self) -> str:
        return f"redis://127.0.0.1:{self.kv_port}"

    def start_kv(self) -> RunningServer:
        return start_process_server(self.workdir / "kvdata", port=self.kv_port,
                                    dram_capacity="256MiB")  # fmt: skip

    def redis(self) -> redis.Redis:
        return redis.Redis(port=self.kv_port, socket_timeout=10)

    def stored_chunks(self) -> int:
        try:
            return int(self.redis().dbsize())
        except redis.RedisError:
            return -1

    def launch(self, name: str, *, interface_v1: bool) -> SGLangServer:
        srv = launch(self.model, free_port(), self.workdir, name=name, kv_url=self.kv_url,
                     max_total_tokens=DEVICE_TOKENS, interface_v1=interface_v1)  # fmt: skip
        self.servers[name] = srv
        return srv

    def ask(self, srv: SGLangServer, seed: int) -> Reply:
        return reply(srv.generate(words(PROMPT, seed)))

    def ask_stored(self, srv: SGLangServer, seed: int) -> Reply:
        """Ask a new prompt and wait until its pages are in kvstrata (HiCache backs them up
        in the background, after the reply)."""
        before = self.stored_chunks()
        got = self.ask(srv, seed)
        assert got.cached_tokens == 0, got
        self.first[seed] = got
        wait_until(lambda: self.stored_chunks() >= before + STORED // PAGE,
                   f"{STORED // PAGE} pages of prompt {seed} in kvstrata", 120)  # fmt: skip
        return got

    def close(self) -> None:
        for srv in self.servers.values():
            srv.stop()
        self.kv.stop()


def storage_tokens(raw: dict) -> int:
    details = raw["meta_info"].get("cached_tokens_details") or {}
    return int(details.get("storage", 0))


def assert_l3_hit(stack: Stack, srv: SGLangServer, seed: int) -> None:
    raw = srv.generate(words(PROMPT, seed))
    got, first = reply(raw), stack.first[seed]
    assert storage_tokens(raw) == STORED, (raw["meta_info"], srv.log_text()[-3000:])
    assert got.cached_tokens == STORED
    assert got.ids == first.ids and got.text == first.text
    assert got.logprobs == pytest.approx(first.logprobs, abs=1e-4)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("sglang-server")
    s = Stack(work, write_model(work / "tiny-llama"))
    try:
        a = s.launch("a", interface_v1=True)
        b = s.launch("b", interface_v1=False)  # started together: the start-ups overlap
        a.wait_ready()
        b.wait_ready()
        yield s
    finally:
        s.close()


def test_flush_then_l3_hit(stack: Stack) -> None:
    a = stack.servers["a"]
    stack.ask_stored(a, seed=1)
    a.flush_cache()
    assert_l3_hit(stack, a, seed=1)
    assert "KvstrataHiCacheStorage" in a.log_text() or "kvstrata" in a.log_text()


def test_second_server_reads_what_the_first_stored(stack: Stack) -> None:
    """B (generic batch_get/batch_set path) never saw prompt 1: its pages come from kvstrata,
    written by A through the zero-copy v1 path (page_first pages are byte-identical)."""
    assert_l3_hit(stack, stack.servers["b"], seed=1)
    stack.ask_stored(stack.servers["b"], seed=2)
    stack.servers["a"].flush_cache()
    assert_l3_hit(stack, stack.servers["a"], seed=2)


def test_evicted_from_device_and_host_pools_then_l3_hit(stack: Stack) -> None:
    a = stack.servers["a"]
    stack.ask_stored(a, seed=3)
    for i in range(FILLERS):  # more than the device and host pools hold together
        filler = reply(a.generate(words(2000, 1000 + i), max_new_tokens=1))
        assert filler.prompt_tokens == 2000
    assert_l3_hit(stack, a, seed=3)


def test_restarted_sglang_reads_l3(stack: Stack) -> None:
    stack.servers["a"].stop()
    a2 = stack.launch("a2", interface_v1=True).wait_ready()
    assert_l3_hit(stack, a2, seed=1)
    assert_l3_hit(stack, a2, seed=3)


def test_kvstrata_killed_sglang_keeps_answering_then_hits_resume(stack: Stack) -> None:
    a2, b = stack.servers["a2"], stack.servers["b"]
    assert stack.kv.process is not None
    os.kill(stack.kv.process.pid, signal.SIGKILL)
    stack.kv.process.wait(30)
    for srv in (a2, b):
        srv.flush_cache()
        got = stack.ask(srv, seed=1)  # stored, but L3 is gone: recomputed, same answer
        first = stack.first[1]
        assert got.cached_tokens == 0 and got.ids == first.ids and got.text == first.text
        assert got.logprobs == pytest.approx(first.logprobs, abs=1e-4)
    stack.kv = stack.start_kv()  # the same port: the backends reconnect
    wait_until(lambda: stack.stored_chunks() >= 0, "kvstrata back", 30)
    stack.ask_stored(a2, seed=4)
    a2.flush_cache()
    assert_l3_hit(stack, a2, seed=4)
    assert_l3_hit(stack, b, seed=4)


def test_the_outage_was_misses_inside_the_backend(stack: Stack) -> None:
    """While kvstrata was down the backend turned every failure into HiCache's miss values and
    logged it; no exception reached SGLang's prefetch or backup threads."""
    for name in ("a2", "b"):
        log = stack.servers[name].log_text()
        assert "kvstrata HiCache storage" in log and "failed" in log, name
        assert "HiCache prefetch transfer failed" not in log, log[-4000:]
        assert "HiCache prefetch success" in log
