"""kvstrata as llama.cpp's prompt cache, through llama-cpp-python: a conversation's context
stays warm across processes and restarts, cut into 256-token chunks under chained prefix
hashes so prompts that share a prefix share chunks.

Pinned to **llama-cpp-python 0.3.36** (the ``llamacpp`` extra) and the llama.cpp it vendors;
the byte format is in :mod:`kvstrata.clients.llamacpp_state`. Use::

    llm = Llama("model.gguf", n_ctx=8192)
    cache = KvstrataLlamaPrefix(llm, Client(port=7379))
    tokens = llm.tokenize(prompt.encode())
    cache.restore(tokens)        # the longest cached prefix, loaded into sequence 0
    out = llm.create_completion(tokens, max_tokens=64)  # computes only the rest
    cache.store()                # the context's full chunks that the server lacks

``restore`` asks the server in one round trip (``KV.MATCH``) how much of the prompt is cached,
reads those chunks (``KV.MGET``), assembles them into one state and hands it to
``llama_state_seq_set_data``; llama-cpp-python's own prefix reuse then sees the restored tokens
in ``input_ids`` and evaluates only the rest. A prompt cached in full is restored one token
short (the next-token logits need one evaluated token). ``store`` reads the sequence once
(``llama_state_seq_get_data``; skipped when every chunk is on the server) and writes only the
missing chunks, linked to their parents (``put_chain``).

:class:`KvstrataLlamaCache` is the same behind ``Llama.set_cache`` for code that already uses
it; it pays llama-cpp-python's ``LlamaState`` costs (``save_state`` copies the whole context
and ``scores``, ``n_batch × n_vocab`` float32: ~263 MB per save at a 128k vocabulary), so
:class:`KvstrataLlamaPrefix` is the one to use.

The namespace names everything that changes the KV bytes or their layout: the llama-cpp-python
version (it pins the llama.cpp build) and the CPU features it runs with, the whole GGUF file
(SHA-256, computed once per path, size and mtime), the KV layout (``v_trans``, i.e. flash
attention off, the K/V types, the layers), RoPE/YaRN overrides and a LoRA. V is kept in the
layout llama.cpp wrote: flash attention on and off compute different KV bits, so they never
share chunks. Refused with :class:`UnsupportedContext`, never cut wrongly: recurrent and
hybrid models, sliding-window attention, M-RoPE, encoder-decoder models, several KV streams.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
from collections.abc import Sequence
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp.llama_cache import BaseLlamaCache

from kvstrata.chunks import validate_namespace
from kvstrata.clients.handles import RegionMapError
from kvstrata.clients.llamacpp_state import (
    KVLayout,
    StateError,
    assemble,
    encode_chunk,
    parse_state,
)
from kvstrata.protocol.errors import LeaseLimitError
from kvstrata.store.hashing import chunk_hashes

__all__ = [
    "KvstrataLlamaCache",
    "KvstrataLlamaPrefix",
    "StateError",
    "UnsupportedContext",
    "context_layout",
    "gguf_digest",
    "llama_namespace",
    "read_state",
]

CHUNK_TOKENS = 256
_DIGESTS: dict[tuple[str, int, int], str] = {}
_DIGESTS_LOCK = threading.Lock()


class UnsupportedContext(ValueError):
    """A model or context whose KV this adapter cannot cut per token."""


def gguf_digest(path: str | os.PathLike[str]) -> str:
    """SHA-256 of the whole model file, hashed once per (path, size, mtime) in this process."""
    real = os.path.realpath(path)
    st = os.stat(real)
    key = (real, st.st_size, st.st_mtime_ns)
    with _DIGESTS_LOCK:
        if key in _DIGESTS:
            return _DIGESTS[key]
    h = hashlib.sha256()
    with open(real, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    with _DIGESTS_LOCK:
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def context_layout(llm: Any) -> KVLayout:
    """The KV layout llama.cpp writes for ``llm``'s context, or :class:`UnsupportedContext`."""
    model = llm._model.model
    cp = llm.context_params
    refuse = [
        (llama_cpp.llama_model_is_recurrent(model), "a recurrent model"),
        (llama_cpp.llama_model_is_hybrid(model), "a hybrid (recurrent + attention) model"),
        (llama_cpp.llama_model_has_encoder(model), "an encoder-decoder model"),
        (llama_cpp.llama_model_n_swa(model) > 0, "sliding-window attention"),
        (
            llama_cpp.llama_model_rope_type(model)
            in (
                llama_cpp.LLAMA_ROPE_TYPE_MROPE,
                llama_cpp.LLAMA_ROPE_TYPE_IMROPE,
                llama_cpp.LLAMA_ROPE_TYPE_VISION,
            ),
            "M-RoPE (per-cell positions)",
        ),
        (cp.n_seq_max > 1 and not cp.kv_unified, "several KV streams (n_seq_max > 1)"),
    ]
    for bad, what in refuse:
        if bad:
            raise UnsupportedContext(f"kvstrata cannot cut the KV of {what}")
    if cp.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED:
        v_trans = False
    elif cp.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED:
        v_trans = True
    else:
        raise UnsupportedContext("flash attention 'auto': pass flash_attn=True or False")
    arch = llm.metadata.get("general.architecture", "")
    n_embd = llama_cpp.llama_model_n_embd(model)
    n_head = llama_cpp.llama_model_n_head(model)
    n_head_kv = llama_cpp.llama_model_n_head_kv(model)
    head_k = int(llm.metadata.get(f"{arch}.attention.key_length", n_embd // n_head))
    head_v = int(llm.metadata.get(f"{arch}.attention.value_length", n_embd // n_head))
    return KVLayout.expected(
        llama_cpp.llama_model_n_layer(model),
        n_head_kv * head_k,
        n_head_kv * head_v,
        int(cp.type_k),
        int(cp.type_v),
        v_trans,
    )


def llama_namespace(llm: Any, layout: KVLayout, chunk_tokens: int = CHUNK_TOKENS) -> str:
    """``llamacpp:<arch>@0.3.36.<cpu>@<gguf>@<layout>@r<rope,lora>@c256``."""
    cp = llm.context_params
    arch = "".join(c for c in llm.metadata.get("general.architecture", "x") if c.isalnum())[:32]
    cpu = hashlib.sha256(llama_cpp.llama_print_system_info()).hexdigest()[:8]
    rope = [
        cp.rope_freq_base,
        cp.rope_freq_scale,
        cp.rope_scaling_type,
        cp.yarn_ext_factor,
        cp.yarn_attn_factor,
        cp.yarn_beta_fast,
        cp.yarn_beta_slow,
        cp.yarn_orig_ctx,
    ]
    lora = [gguf_digest(llm.lora_path), llm.lora_scale] if llm.lora_path else []
    extra = hashlib.sha256(repr([*rope, *lora]).encode()).hexdigest()[:8]
    model = gguf_digest(llm.model_path)[:24]
    return validate_namespace(
        f"llamacpp:{arch}@{llama_cpp.__version__}.{cpu}@{model}@{layout.tag()}@r{extra}"
        f"@c{chunk_tokens}"
    )


class KvstrataLlamaPrefix:
    """Restores and stores one ``Llama``'s sequence ``seq_id`` through a kvstrata client
    (:class:`kvstrata.clients.sync.Client`: ``match``, ``lease``, ``mget``, ``put_chain``)."""

    def __init__(
        self, llm: Any, client: Any, *, chunk_tokens: int = CHUNK_TOKENS, seq_id: int = 0
    ) -> None:
        self.llm = llm
        self.client = client
        self.chunk_tokens = chunk_tokens
        self.seq_id = seq_id
        self.layout = context_layout(llm)
        self.namespace = llama_namespace(llm, self.layout, chunk_tokens)
        #: False once the server's arena proved unreachable from here (reads by KV.MGET)
        self.shared_memory = True

    def hashes(self, tokens: Sequence[int] | np.ndarray) -> list[bytes]:
        return chunk_hashes(np.asarray(tokens, dtype=np.int64), self.namespace, self.chunk_tokens)

    def cached(self, tokens: Sequence[int] | np.ndarray) -> int:
        """How many leading tokens of ``tokens`` the server holds (full chunks)."""
        hashes = self.hashes(tokens)
        return self.client.match(self.namespace, hashes) * self.chunk_tokens if hashes else 0

    def restore(self, tokens: Sequence[int] | np.ndarray) -> int:
        """Load the longest cached prefix of ``tokens`` (at most ``len(tokens) - 1``) into the
        context; the number of tokens loaded, 0 when the context already holds as much."""
        toks = np.asarray(tokens, dtype=np.int64)
        n = min(self.cached(toks), len(toks) - 1, self.llm.n_ctx())
        if n <= _common_prefix(self.llm.input_ids[: self.llm.n_tokens], toks):
            return 0
        state, n = self.load(toks, n)
        if n <= 0:
            return 0
        self._set_state(state, toks[:n])
        return n

    def load(self, tokens: np.ndarray, n: int, arch: str | None = None) -> tuple[bytearray, int]:
        """The state of the first ``n`` tokens assembled from their chunks, and its length in
        tokens (shorter when a chunk was evicted since the match; 0: nothing). Read in place
        from the server's shared memory (``KV.LEASE``) on its host, else by ``KV.MGET``.
        ``arch``: the whole-context form (``llama_state_set_data``)."""
        want = self.hashes(tokens)[: -(-n // self.chunk_tokens)]
        lease = None
        if self.shared_memory:
            try:
                lease = self.client.lease(self.namespace, want, tier="dram")
            except RegionMapError:  # the server runs on another host
                self.shared_memory = False
            except LeaseLimitError:  # leases are all taken: read over the socket this time
                pass
        if lease is not None:
            with lease:
                return self._assembled(lease.views(), n, arch)
        got = self.client.mget(self.namespace, want)
        present = next((i for i, p in enumerate(got) if p is None), len(got))
        return self._assembled(got[:present], n, arch)

    def _assembled(
        self, payloads: Sequence[Any], n: int, arch: str | None
    ) -> tuple[bytearray, int]:
        # a lease or a read stops at the first chunk evicted since the match
        n = min(n, len(payloads) * self.chunk_tokens)
        if n <= 0:
            return bytearray(), 0
        return assemble(payloads, n, self.layout, self.seq_id, arch), n

    def _set_state(self, state: bytearray, tokens: np.ndarray) -> None:
        llm = self.llm
        buf = (ctypes.c_uint8 * len(state)).from_buffer(state)
        got = llama_cpp.llama_state_seq_set_data(llm._ctx.ctx, buf, len(state), self.seq_id)
        if got != len(state):
            llm.n_tokens = 0  # llama.cpp emptied the sequence when it refused the state
            raise StateError(f"llama.cpp refused the assembled state ({got} of {len(state)} bytes)")
        n = len(tokens)
        llm.input_ids[:n] = tokens
        llm.n_tokens = n
        llm._requires_eval = True  # the next-token logits come from evaluating the rest

    def store(self) -> int:
        """Store the context's full chunks the server lacks; the number of tokens stored."""
        llm = self.llm
        tokens = np.array(llm.input_ids[: llm.n_tokens], dtype=np.int64)
        hashes = self.hashes(tokens)
        have = self.client.match(self.namespace, hashes) if hashes else 0
        if have == len(hashes):
            return 0
        state = parse_state(read_state(llm, self.seq_id), self.layout)
        return self.put(state, hashes, have)

    def put(self, state: Any, hashes: list[bytes], have: int) -> int:
        c = self.chunk_tokens
        payloads = [encode_chunk(state, i * c, (i + 1) * c) for i in range(have, len(hashes))]
        parent = hashes[have - 1] if have else None
        result = self.client.put_chain(self.namespace, hashes[have:], payloads, parent, tokens=c)
        return sum(r == "stored" for r in result) * c


class KvstrataLlamaCache(BaseLlamaCache):
    """``Llama.set_cache`` over kvstrata for code that already uses llama-cpp-python's cache
    (see the module docstring for its cost). ``capacity_bytes`` is the server's business;
    ``cache_size`` counts the bytes this object stored."""

    def __init__(self, llm: Any, client: Any, *, chunk_tokens: int = CHUNK_TOKENS) -> None:
        super().__init__(capacity_bytes=0)
        self.prefix = KvstrataLlamaPrefix(llm, client, chunk_tokens=chunk_tokens)
        self.arch = llm.metadata.get("general.architecture", "")
        self.stored_bytes = 0

    @property
    def cache_size(self) -> int:
        return self.stored_bytes

    def __contains__(self, key: Sequence[int]) -> bool:
        return self.prefix.cached(key) > 0

    def __getitem__(self, key: Sequence[int]) -> Any:
        toks = np.asarray(key, dtype=np.int64)
        n = min(self.prefix.cached(toks), len(toks))
        state, n = self.prefix.load(toks, n, self.arch) if n else (bytearray(), 0)
        if n == 0:
            raise KeyError("no cached prefix")
        llm = self.prefix.llm
        input_ids = np.full(llm.n_ctx(), -1, dtype=np.intc)  # -1: never a token of a prompt
        input_ids[:n] = toks[:n]
        scores = np.zeros((1, llm.n_vocab()), dtype=np.single)  # broadcast by load_state
        return llama_cpp.llama.LlamaState(input_ids, scores, n, bytes(state), len(state), llm._seed)

    def __setitem__(self, key: Sequence[int], value: Any) -> None:
        state = parse_state(value.llama_state, self.prefix.layout, context=True)
        if state.arch != self.arch:
            raise StateError(f"state of a {state.arch!r} model, this cache holds {self.arch!r}")
        tokens = np.array(value.input_ids[: value.n_tokens], dtype=np.int64)
        hashes = self.prefix.hashes(tokens)
        have = self.prefix.client.match(self.prefix.namespace, hashes) if hashes else 0
        if have < len(hashes):
            stored = self.prefix.put(state, hashes, have)
            self.stored_bytes += stored * self.prefix.layout.cell_bytes


def read_state(llm: Any, seq_id: int = 0) -> memoryview:
    """``llama_state_seq_get_data`` of ``llm``'s sequence ``seq_id``."""
    ctx = llm._ctx.ctx
    size = llama_cpp.llama_state_seq_get_size(ctx, seq_id)
    buf = (ctypes.c_uint8 * size)()
    n = llama_cpp.llama_state_seq_get_data(ctx, buf, size, seq_id)
    if n != size or size == 0:
        raise StateError(f"llama.cpp wrote {n} bytes of a {size}-byte sequence state")
    return memoryview(buf).cast("B")


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n
