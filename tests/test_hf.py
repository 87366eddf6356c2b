"""transformers integration against an in-memory client: restored prefixes give the logits and
greedy generations of a full recompute; reuse is by full chunks of the same namespace only."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch
from transformers.cache_utils import DynamicLayer

from kvstrata.chunks import validate_namespace
from kvstrata.clients.hf import HFPrefixCache
from kvstrata.clients.hf_model import model_namespace
from tests.hf_fakes import FakeKVClient, recompute_greedy, recompute_logits, tiny_llama

C = 16  # tokens per chunk
# fp32 logits of this model are O(0.1-1); a single-pass and a split prefill differ only by
# float reassociation (GEMMs of other shapes, SDPA over other query lengths): ~1e-7 measured.
REASSOC_ATOL = 1e-5


@pytest.fixture(scope="module")
def model() -> object:
    return tiny_llama()


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 500, (1, n), generator=torch.Generator().manual_seed(seed))


def _warm(model: object, client: FakeKVClient, ids: torch.Tensor, **kw: object) -> HFPrefixCache:
    pc = HFPrefixCache(model, client, chunk_tokens=C, **kw)  # type: ignore[arg-type]
    first = pc.prefill(ids)
    assert first.reused_tokens == 0
    pc.wait_stored()
    return pc


def test_namespace_names_model_dtype_codec_chunk_and_weights(model: object) -> None:
    ns = model_namespace(model, chunk_tokens=C)
    assert validate_namespace(ns) == ns and ns.startswith("hf:LlamaForCausalLM@L2.kv2.d16.h64@")
    assert model_namespace(tiny_llama(), chunk_tokens=C) == ns  # same config, same weights
    others = {
        model_namespace(model, chunk_tokens=C, codec="int8"),
        model_namespace(model, chunk_tokens=2 * C),
        model_namespace(tiny_llama(seed=5), chunk_tokens=C),  # other weights
        model_namespace(tiny_llama(layers=3), chunk_tokens=C),
        model_namespace(tiny_llama(dtype=torch.bfloat16), chunk_tokens=C),
    }
    assert ns not in others and len(others) == 5


def test_raw_restore_is_exact(model: object) -> None:
    """Store a 64-token prompt, then extend it: the restored 64 tokens plus a 6-token prefill
    are bitwise equal to a recompute split at the same place, and equal to a single-pass
    recompute up to float reassociation; greedy generations are identical."""
    ids = _ids(70)
    client = FakeKVClient()
    pc = _warm(model, client, ids[:, :64])
    assert len(client.store) == 4
    res = pc.prefill(ids)
    assert (res.reused_tokens, res.computed_tokens, res.matched_chunks) == (64, 6, 4)
    assert res.tiers == ("dram",) * 4
    assert torch.equal(res.logits, recompute_logits(model, ids, split=64))
    torch.testing.assert_close(res.logits, recompute_logits(model, ids), rtol=0, atol=REASSOC_ATOL)
    gen = pc.generate(ids, 12, store=False)
    assert gen.prefill.reused_tokens == 64
    assert gen.tokens == recompute_greedy(model, ids, 12)


# Per-element error of each codec (tests/test_codecs.py): fp8 <= 2**-4 of the value, int8 <=
# 1/510 and int4 <= 1/30 of the channel/token range. Attention output is a convex mix of values
# and the scores move by the key error, so the logits error is a similar fraction of the effect
# the prefix's KV has at all; measured against dropping that KV (zeroed): fp8 1.3 %, int8 0.24 %,
# int4 3.1 %. Bounds below leave ~3x headroom.
LOSSY_FRACTION = {"fp8": 0.04, "int8": 0.01, "int4": 0.10}


@pytest.mark.parametrize("codec", ["fp8", "int8", "int4"])
def test_lossy_restore_within_tolerance(model: object, codec: str) -> None:
    ids = _ids(70)
    client = FakeKVClient()
    pc = _warm(model, client, ids[:, :64], codec=codec)
    res = pc.prefill(ids)
    assert res.reused_tokens == 64
    full = recompute_logits(model, ids)
    zeroed = _logits_with_zeroed_prefix(pc, ids)
    information = (zeroed - full).abs().max()
    error = (res.logits - full).abs().max()
    assert error <= LOSSY_FRACTION[codec] * information
    assert int(res.logits.argmax()) == int(full.argmax())


def _logits_with_zeroed_prefix(pc: HFPrefixCache, ids: torch.Tensor) -> torch.Tensor:
    raw = HFPrefixCache(pc.model, FakeKVClient(), chunk_tokens=C)
    res = raw.prefill(ids[:, :64], store=False)
    for layer in res.cache.layers:
        assert isinstance(layer, DynamicLayer) and layer.keys is not None
        assert layer.values is not None
        layer.keys = torch.zeros_like(layer.keys)
        layer.values = torch.zeros_like(layer.values)
    return raw._forward(ids[:, 64:], res.cache)


def test_multi_turn_reuses_previous_turn(model: object) -> None:
    """Turn 2 = turn 1's prompt + reply + a new message: it reuses every full chunk of turn 1
    (prompt and reply) and its greedy continuation equals a full recompute."""
    client = FakeKVClient()
    pc = HFPrefixCache(model, client, chunk_tokens=C)
    turn1 = _ids(40, seed=2)
    g1 = pc.generate(turn1, 10)
    assert g1.prefill.reused_tokens == 0
    assert pc.wait_stored() == 3  # 2 chunks of the prompt, then 49 cached tokens -> chunk 3
    turn2 = torch.cat([turn1, torch.tensor([g1.tokens]), _ids(20, seed=3)], dim=1)
    g2 = pc.generate(turn2, 8)
    assert g2.prefill.reused_tokens == 48 and g2.prefill.computed_tokens == 70 - 48
    assert g2.tokens == recompute_greedy(model, turn2, 8)
    pc.wait_stored()
    assert client.match(pc.namespace, pc.hashes(turn2)) == 4


def test_divergence_mid_chunk_reuses_only_full_matching_chunks(model: object) -> None:
    ids = _ids(64)
    client = FakeKVClient()
    pc = _warm(model, client, ids)
    other = ids.clone()
    other[0, 40] = (int(other[0, 40]) + 1) % 500  # inside chunk 2
    res = pc.prefill(other, store=False)
    assert (res.matched_chunks, res.reused_tokens, res.computed_tokens) == (2, 32, 32)
    torch.testing.assert_close(
        res.logits, recompute_logits(model, other), rtol=0, atol=REASSOC_ATOL
    )


def test_fully_cached_prompt_recomputes_only_its_last_token(model: object) -> None:
    ids = _ids(64)
    pc = _warm(model, FakeKVClient(), ids)
    res = pc.prefill(ids)
    assert (res.matched_chunks, res.reused_tokens, res.computed_tokens) == (4, 63, 1)
    torch.testing.assert_close(res.logits, recompute_logits(model, ids), rtol=0, atol=REASSOC_ATOL)


def test_other_model_or_codec_does_not_match(model: object) -> None:
    ids = _ids(64)
    client = FakeKVClient()
    _warm(model, client, ids)
    for other in (
        HFPrefixCache(model, client, chunk_tokens=C, codec="int8"),
        HFPrefixCache(tiny_llama(seed=9), client, chunk_tokens=C),
        HFPrefixCache(tiny_llama(layers=3), client, chunk_tokens=C),
    ):
        assert other.prefill(ids, store=False).reused_tokens == 0


def test_chunk_vanishing_after_match_falls_back_to_compute(model: object) -> None:
    ids = _ids(64)
    client = FakeKVClient()
    pc = _warm(model, client, ids)
    client.drop.add(pc.hashes(ids)[2])
    res = pc.prefill(ids, store=False)
    assert res.matched_chunks == 4 and res.reused_tokens == 32
    torch.testing.assert_close(res.logits, recompute_logits(model, ids), rtol=0, atol=REASSOC_ATOL)


def test_stores_run_behind_generation(model: object) -> None:
    """With every put blocked, generation still completes; the chunks land once puts proceed,
    each after its parent, with its token count."""
    store: dict[tuple[str, bytes], bytes] = {}
    fg, bg = FakeKVClient(store), FakeKVClient(store)
    bg.put_gate = threading.Event()
    pc = HFPrefixCache(model, fg, chunk_tokens=C, store_client=bg)
    ids = _ids(50)
    gen = pc.generate(ids, 5)
    assert len(gen.tokens) == 5 and not store  # nothing stored yet, generation done
    bg.put_gate.set()
    assert pc.wait_stored(timeout=30) == 3
    assert [p[3] for p in bg.puts] == [C, C, C] and bg.puts[0][2] == b""
    pc.close()


def test_store_a_cache_computed_elsewhere(model: object) -> None:
    """An engine that ran the model itself hands its cache over; the next prompt reuses it."""
    ids = _ids(40)
    with torch.inference_mode():
        cache = model(ids, use_cache=True).cache  # type: ignore[operator]
    client = FakeKVClient()
    pc = HFPrefixCache(model, client, chunk_tokens=C)
    pc.store(ids, cache)
    assert pc.wait_stored() == 2
    res = pc.prefill(ids, store=False)
    assert res.reused_tokens == 32
    torch.testing.assert_close(res.logits, recompute_logits(model, ids), rtol=0, atol=REASSOC_ATOL)


class _FailingPuts(FakeKVClient):
    """A client whose first ``fails`` puts raise."""

    def __init__(self, fails: int) -> None:
        super().__init__()
        self.fails = fails

    def put(
        self, namespace: str, hash: bytes, parent: bytes | None, payload: object, tokens: int = 0
    ) -> bool:
        if self.fails:
            self.fails -= 1
            raise ConnectionError(f"put failed, {self.fails} more to go")
        return super().put(namespace, hash, parent, payload, tokens)


def test_wait_stored_counts_every_failed_store_and_raises_the_first(model: object) -> None:
    """Three background stores, the first two fail: wait_stored waits for all three, records
    both errors, raises the first; the third store landed and a second wait has nothing left."""
    client = _FailingPuts(fails=2)
    pc = HFPrefixCache(model, client, chunk_tokens=C)
    for seed in (1, 2, 3):
        ids = _ids(C, seed)
        with torch.inference_mode():
            cache = model(ids, use_cache=True).cache  # type: ignore[operator]
        pc.store(ids, cache)
    with pytest.raises(ConnectionError, match="1 more to go"):
        pc.wait_stored(timeout=30)
    assert [str(e) for e in pc.store_errors] == [
        "put failed, 1 more to go",
        "put failed, 0 more to go",
    ]
    assert len(client.store) == 1
    assert pc.wait_stored() == 1
    pc.close()
