"""An in-memory stand-in for the kvstrata client, and a tiny random Llama, for the HF tests."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from kvstrata.clients.results import MatchResult


class FakeKVClient:
    """Implements the :class:`kvstrata.clients.hf.KVClient` protocol on a dict.

    ``store`` may be shared between instances (one per thread, as a real deployment would
    open a second connection for background stores). ``put_gate``, when set, makes every
    ``put`` wait for it, to show that generation does not wait for stores. ``drop`` names
    hashes that vanish between ``match`` and ``mget`` (an eviction race).
    """

    def __init__(self, store: dict[tuple[str, bytes], bytes] | None = None) -> None:
        self.store: dict[tuple[str, bytes], bytes] = {} if store is None else store
        self.put_gate: threading.Event | None = None
        self.drop: set[bytes] = set()
        self.puts: list[tuple[str, bytes, bytes | None, int]] = []
        self.tier = "dram"

    def match(self, namespace: str, hashes: Sequence[bytes]) -> int:
        n = 0
        for h in hashes:
            if (namespace, h) not in self.store:
                break
            n += 1
        return n

    def match_tiers(self, namespace: str, hashes: Sequence[bytes]) -> MatchResult:
        n = self.match(namespace, hashes)
        return MatchResult(n, (self.tier,) * n)

    def mget(
        self, namespace: str, hashes: Sequence[bytes], outs: Sequence[Any] | None = None
    ) -> list[Any]:
        result: list[Any] = []
        for i, h in enumerate(hashes):
            payload = None if h in self.drop else self.store.get((namespace, h))
            if payload is None or outs is None:
                result.append(payload)
                continue
            view = memoryview(outs[i]).cast("B")
            view[: len(payload)] = payload
            result.append(view[: len(payload)])
        return result

    def put(
        self, namespace: str, hash: bytes, parent: bytes | None, payload: Any, tokens: int = 0
    ) -> bool:
        if self.put_gate is not None:
            assert self.put_gate.wait(30), "test never opened the put gate"
        if parent:
            assert (namespace, parent) in self.store, "a chunk is stored before its parent"
        self.store[(namespace, hash)] = bytes(payload)
        self.puts.append((namespace, hash, parent, tokens))
        return True


def tiny_llama(seed: int = 0, layers: int = 2, dtype: torch.dtype = torch.float32) -> Any:
    """A Llama-shaped model with random weights: 2 layers, GQA (4 query, 2 KV heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=500,
        max_position_embeddings=4096,
    )
    model: Any = LlamaForCausalLM(config)
    model = model.to(dtype).eval()
    model.generation_config.eos_token_id = None  # random weights: never stop early
    model.generation_config.pad_token_id = 0
    return model


@torch.inference_mode()
def recompute_logits(model: Any, ids: torch.Tensor, split: int | None = None) -> torch.Tensor:
    """Next-token logits by full recompute; with ``split``, prefill in two passes at ``split``
    (the same operations a restored prefix of ``split`` tokens goes through)."""
    if split is None:
        return model(ids, use_cache=True, logits_to_keep=1).logits[0, -1].float()
    first = model(ids[:, :split], use_cache=True, logits_to_keep=1)
    out = model(ids[:, split:], cache=first.cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1].float()


@torch.inference_mode()
def recompute_greedy(model: Any, ids: torch.Tensor, n: int) -> list[int]:
    out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return [int(t) for t in out[0, ids.shape[1] :]]
