"""kvstrata as llama.cpp's prompt cache through llama-cpp-python 0.3.36, against a ``kvstrata
serve`` subprocess on loopback and a tiny random Llama converted to GGUF at test time.

Every scenario compares with a full recompute in a fresh context of the same settings: the
last prompt token's logits bit-identical (max difference 0.0) and 24 greedy tokens identical."""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from kvstrata.clients.llamacpp import (
    KvstrataLlamaCache,
    KvstrataLlamaPrefix,
    StateError,
    UnsupportedContext,
    context_layout,
    read_state,
)
from kvstrata.clients.llamacpp_state import assemble, encode_chunk, parse_state
from kvstrata.clients.sync import Client
from tests.conftest import RunningServer
from tests.engines.llamacpp.harness import (
    greedy,
    last_logits,
    make_llm,
    prompt_tokens,
    store_in_fresh_process,
)
from tests.engines.llamacpp.model import Shape, build_gguf

TEXT = "the project cache keeps context warm so follow up questions start at once"
STEPS = 24


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    return {"a": build_gguf(root), "b": build_gguf(root, Shape(seed=1))}


@pytest.fixture
def kv(make_process_server: Callable[..., RunningServer]) -> RunningServer:
    return make_process_server(dram_capacity="64MiB", nvme_write_policy="write-through")


@pytest.fixture
def client(kv: RunningServer) -> Iterator[Client]:
    with Client(port=kv.port) as c:
        yield c


def recompute(model: Path, flash: bool, tokens: list[int]) -> tuple[np.ndarray, list[int]]:
    llm = make_llm(model, flash)
    llm.eval(tokens)
    return last_logits(llm), greedy(llm, STEPS)


def restored(
    model: Path, flash: bool, tokens: list[int], port: int, shared_memory: bool = True
) -> tuple[int, np.ndarray, list[int]]:
    """Restore into a fresh context (reading chunks in place from the server's shared memory,
    or with ``shared_memory=False`` by KV.MGET), compute the rest and 24 greedy tokens."""
    llm = make_llm(model, flash)
    with Client(port=port) as c:
        prefix = KvstrataLlamaPrefix(llm, c)
        prefix.shared_memory = shared_memory
        n = prefix.restore(tokens)
    assert llm.n_tokens == n
    llm.eval(tokens[n:])
    return n, last_logits(llm), greedy(llm, STEPS)


def assert_same(a: tuple[np.ndarray, list[int]], b: tuple[np.ndarray, list[int]]) -> None:
    assert float(np.max(np.abs(a[0] - b[0]))) == 0.0
    assert a[0].tobytes() == b[0].tobytes()
    assert a[1] == b[1]


@pytest.mark.parametrize("flash", [False, True], ids=["flash-off", "flash-on"])
def test_store_in_one_process_restore_in_a_fresh_one(
    models: dict[str, Path], kv: RunningServer, flash: bool
) -> None:
    """A prompt of 4 chunks and 77 tokens stored by one process is restored (1,024 tokens)
    into a fresh context; the rest is computed; logits and greedy tokens equal a recompute."""
    llm = make_llm(models["a"], flash)
    tokens = prompt_tokens(llm, TEXT, 4 * 256 + 77)
    report = store_in_fresh_process(models["a"], kv.port, flash, tokens)
    assert report["stored"] == 1024
    want = recompute(models["a"], flash, tokens)
    for shared_memory in (True, False):
        n, logits, steps = restored(models["a"], flash, tokens, kv.port, shared_memory)
        assert n == 1024
        assert_same((logits, steps), want)


def test_a_prompt_cached_in_full_is_restored_one_token_short(
    models: dict[str, Path], kv: RunningServer
) -> None:
    llm = make_llm(models["a"], False)
    tokens = prompt_tokens(llm, TEXT, 3 * 256)
    assert store_in_fresh_process(models["a"], kv.port, False, tokens)["stored"] == 768
    n, logits, steps = restored(models["a"], False, tokens, kv.port)
    assert n == 767
    assert_same((logits, steps), recompute(models["a"], False, tokens))


def test_after_a_server_restart_chunks_come_from_nvme(
    models: dict[str, Path], make_process_server: Callable[..., RunningServer], tmp_path: Path
) -> None:
    data = tmp_path / "kvdata"
    first = make_process_server(data_dir=data, nvme_write_policy="write-through")
    llm = make_llm(models["a"], True)
    tokens = prompt_tokens(llm, TEXT, 2 * 256 + 10)
    assert store_in_fresh_process(models["a"], first.port, True, tokens)["stored"] == 512
    first.stop()
    again = make_process_server(data_dir=data, nvme_write_policy="write-through")
    with Client(port=again.port) as c:
        prefix = KvstrataLlamaPrefix(llm, c)
        assert c.match_tiers(prefix.namespace, prefix.hashes(tokens)).tiers == ("nvme", "nvme")
    n, logits, steps = restored(models["a"], True, tokens, again.port)
    assert n == 512
    assert_same((logits, steps), recompute(models["a"], True, tokens))


def test_prompts_sharing_a_prefix_share_chunks(models: dict[str, Path], client: Client) -> None:
    llm = make_llm(models["a"], False)
    base = prompt_tokens(llm, TEXT, 512)
    one = base + prompt_tokens(llm, "kvstrata stores key value states", 300)[1:]
    two = base + prompt_tokens(llm, "llama cpp reads them back", 300)[1:]
    prefix = KvstrataLlamaPrefix(llm, client)
    llm.eval(one)
    assert prefix.store() == 3 * 256
    llm.reset()
    llm.eval(two)
    assert prefix.store() == 256  # the two shared chunks were on the server already
    keys = redis.Redis(port=client.settings.port).keys(f"kv:{prefix.namespace}:*")
    assert len(keys) == 4
    assert prefix.store() == 0
    n, logits, steps = restored(models["a"], False, two, client.settings.port)
    assert n == 3 * 256
    assert_same((logits, steps), recompute(models["a"], False, two))


def test_another_model_or_attention_kernel_never_hits(
    models: dict[str, Path], client: Client
) -> None:
    llm = make_llm(models["a"], False)
    tokens = prompt_tokens(llm, TEXT, 600)
    llm.eval(tokens)
    assert KvstrataLlamaPrefix(llm, client).store() == 512
    other = KvstrataLlamaPrefix(make_llm(models["b"], False), client)
    flash = KvstrataLlamaPrefix(make_llm(models["a"], True), client)
    assert other.namespace != flash.namespace
    for p in (other, flash):
        assert p.cached(tokens) == 0 and p.restore(tokens) == 0 and p.llm.n_tokens == 0


def test_truncated_or_altered_chunks_are_refused(models: dict[str, Path], client: Client) -> None:
    """A chunk cut short or with a header naming another layout is never restored: restore
    raises StateError and the context is left untouched."""
    llm = make_llm(models["a"], False)
    tokens = prompt_tokens(llm, TEXT, 300)
    llm.eval(tokens)
    prefix = KvstrataLlamaPrefix(llm, client)
    assert prefix.store() == 256
    (h,) = prefix.hashes(tokens)
    good = client.get(prefix.namespace, h)
    fresh = make_llm(models["a"], False)
    target = KvstrataLlamaPrefix(fresh, client)
    bad_type = bytearray(good)
    struct.pack_into("<i", bad_type, 16, 8)  # layer 0's K type: q8_0
    for bad in (good[:-1], bytes(good) + b"\0", bytes(bad_type)):
        client.delete(prefix.namespace, h)
        assert client.put(prefix.namespace, h, None, bad)
        with pytest.raises(StateError):
            target.restore(tokens)
        assert fresh.n_tokens == 0


def test_a_state_llama_cpp_refuses_raises(models: dict[str, Path], client: Client) -> None:
    """A state the codec accepts but llama.cpp cannot take (more cells than the context has):
    llama.cpp's refusal becomes StateError and the sequence is left empty."""
    llm = make_llm(models["a"], False)
    tokens = prompt_tokens(llm, TEXT, 600)
    llm.eval(tokens)
    prefix = KvstrataLlamaPrefix(llm, client)
    state = parse_state(read_state(llm), prefix.layout)
    chunks = [encode_chunk(state, 0, 256), encode_chunk(state, 256, 512)]
    small = make_llm(models["a"], False, n_ctx=256)
    target = KvstrataLlamaPrefix(small, client)
    with pytest.raises(StateError, match="refused"):
        target._set_state(assemble(chunks, 512, target.layout), np.array(tokens[:512]))
    assert small.n_tokens == 0


def test_set_cache_drop_in(models: dict[str, Path], client: Client) -> None:
    """``Llama.set_cache(KvstrataLlamaCache(...))``: a completion stores its context; a fresh
    ``Llama`` with the same cache loads it and answers as a cold one does."""
    prompt = prompt_tokens(make_llm(models["a"], False), TEXT, 700)
    cold = make_llm(models["a"], False)
    want = cold.create_completion(prompt, max_tokens=STEPS, temperature=0.0)["choices"][0]["text"]
    first = make_llm(models["a"], False)
    first.set_cache(KvstrataLlamaCache(first, client))
    first.create_completion(prompt, max_tokens=STEPS, temperature=0.0)
    assert first.cache is not None and first.cache.cache_size > 0
    fresh = make_llm(models["a"], False)
    cache = Counting(fresh, client)
    assert prompt in cache
    fresh.set_cache(cache)
    got = fresh.create_completion(prompt, max_tokens=STEPS, temperature=0.0)
    assert cache.hits == [512]  # the prompt's two full chunks, loaded by load_state
    assert got["choices"][0]["text"] == want


class Counting(KvstrataLlamaCache):
    hits: list[int]

    def __getitem__(self, key: Any) -> Any:
        state = super().__getitem__(key)
        self.__dict__.setdefault("hits", []).append(state.n_tokens)
        return state


def test_layout_matches_what_llama_cpp_writes(models: dict[str, Path]) -> None:
    """The layout computed from the model and context is what llama.cpp writes."""
    for flash in (False, True):
        llm = make_llm(models["a"], flash)
        llm.eval(prompt_tokens(llm, TEXT, 40))
        layout = context_layout(llm)
        assert layout.v_trans is (not flash)
        assert parse_state(read_state(llm)).layout == layout


def test_a_chunk_evicted_after_the_match_shortens_the_restore(
    models: dict[str, Path], client: Client
) -> None:
    """Between ``KV.MATCH`` and the read a chunk goes away: the lease and the ``KV.MGET``
    both stop there, and the state assembled is the prefix before it."""
    llm = make_llm(models["a"], False)
    tokens = prompt_tokens(llm, TEXT, 800)
    llm.eval(tokens)
    prefix = KvstrataLlamaPrefix(llm, client)
    assert prefix.store() == 768
    assert client.delete(prefix.namespace, prefix.hashes(tokens)[1]) == 1
    for shared_memory in (True, False):
        prefix.shared_memory = shared_memory
        state, n = prefix.load(np.array(tokens), 768)
        assert n == 256
        assert parse_state(state, prefix.layout).n_cells == 256


@pytest.mark.parametrize(
    ("function", "value", "what"),
    [
        ("llama_model_n_swa", 4096, "sliding-window"),
        ("llama_model_is_recurrent", True, "recurrent"),
        ("llama_model_is_hybrid", True, "hybrid"),
        ("llama_model_rope_type", 8, "M-RoPE"),  # LLAMA_ROPE_TYPE_MROPE
    ],
)
def test_caches_it_cannot_cut_are_refused(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, function: str, value: Any, what: str
) -> None:
    """What llama.cpp reports about the model decides: a model whose KV has windows, recurrent
    state or per-cell extras is refused before anything is stored."""
    import llama_cpp

    llm = make_llm(models["a"], False)
    monkeypatch.setattr(llama_cpp, function, lambda *_: value)
    with pytest.raises(UnsupportedContext, match=what):
        context_layout(llm)
