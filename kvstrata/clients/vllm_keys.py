"""Keys of the vLLM tier (:mod:`kvstrata.clients.vllm`): the namespace of one vLLM KV layout, the
chunk hash of an offload key, and whether this process's block hashes can be shared at all.

Nothing here imports vLLM: the functions read the fields of vLLM's ``OffloadingConfig`` by name,
so they are checked without vLLM installed too.

Namespace. Two vLLM instances may share a chunk only when the bytes of a primary-tier row mean
the same thing to both. vLLM's own ``fs`` tier names its folder after exactly those facts
(``FileMapper``: model, dtype, tokens per hash, blocks per chunk, parallel sizes and rank, KV
cache groups) and so does this namespace, plus the row size in bytes. The engine id is left out
on purpose: it differs per instance (and per start), and would stop every sharing.

Chunk hash. vLLM names an offloaded chunk by its ``OffloadKey``: the block hash of the chunk's
last block (32 bytes with the default ``sha256``) followed by the KV cache group index (4 bytes,
big-endian). Both parts are needed (one block hash has one chunk per group), so the whole key is
the kvstrata hash. vLLM's block hash chains over the prefix, so the key names the whole prefix.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

from kvstrata.chunks import MAX_NAMESPACE_BYTES, validate_namespace

__all__ = [
    "layout_fields",
    "shareable_hash_problem",
    "vllm_namespace",
]

_UNSAFE = re.compile(r"[^A-Za-z0-9_.:/+=,%~^-]")
_NON_CRYPTO_ALGOS = ("xxhash", "xxhash_cbor")
_DIGEST_CHARS = 16


def layout_fields(config: Any, row_bytes: int) -> dict[str, Any]:
    """What makes a primary-tier row of ``config`` (vLLM's ``OffloadingConfig``) mean what it
    means: the fields vLLM's ``FileMapper`` hashes into its folder name, and the row size."""
    par = config.parallel
    return {
        "model": str(config.model.name),
        "dtype": str(config.model.dtype),
        "tokens_per_hash": int(config.cache.tokens_per_hash),
        "blocks_per_chunk": int(config.cache.blocks_per_chunk),
        "tp": int(par.tp_size),
        "pp": int(par.pp_size),
        "pcp": int(par.pcp_size),
        "dcp": int(par.dcp_size),
        "rank": int(par.rank),
        "row_bytes": int(row_bytes),
        "groups": [
            [int(g.tokens_per_block), list(g.layer_names), int(g.group_id)]
            for g in config.groups
        ],
        "replicated_layout": bool(getattr(config, "replicated_layout", False)),
        "canonical_layout": bool(getattr(config, "canonical_layout", False)),
        "kv_cache_layout": getattr(config, "kv_cache_layout", None),
    }


def vllm_namespace(config: Any, row_bytes: int, prefix: str | None = None) -> str:
    """The namespace of ``config``'s KV layout, e.g.
    ``vllm:Qwen_Qwen3-0.6B@bfloat16@h16x1@tp1pp1pcp1dcp1r0@b229376#3f9c0d21a4b5e6f7``.

    ``prefix`` (the tier's ``namespace`` option) replaces the model part, e.g. to name a weights
    revision, or to let a local path and its hub id share. The layout part and the digest of
    every field are always appended: bytes of another layout can never be used."""
    f = layout_fields(config, row_bytes)
    digest = hashlib.sha256(json.dumps(f, sort_keys=True, default=str).encode()).hexdigest()
    head = _UNSAFE.sub("_", prefix if prefix is not None else f"vllm:{f['model']}")
    tail = (
        f"@{_UNSAFE.sub('_', f['dtype'])}@h{f['tokens_per_hash']}x{f['blocks_per_chunk']}"
        f"@tp{f['tp']}pp{f['pp']}pcp{f['pcp']}dcp{f['dcp']}r{f['rank']}@b{row_bytes}"
        f"#{digest[:_DIGEST_CHARS]}"
    )
    head = head[: MAX_NAMESPACE_BYTES - len(tail)]  # the digest keeps a cut name distinct
    return validate_namespace(head + tail)


def shareable_hash_problem(algo: str | None, seed: str | None) -> str | None:
    """Why this process's vLLM block hashes cannot match another process's, or None.

    vLLM 0.33 seeds the first block's parent hash (``NONE_HASH``) with ``PYTHONHASHSEED`` when
    set, else with a fixed string for ``sha256``/``sha256_cbor`` (the default ``sha256``:
    shareable), else with random bytes (``xxhash``/``xxhash_cbor``: every process hashes
    differently). ``algo`` is ``--prefix-caching-hash-algo`` when known; ``seed`` the seed the
    engine resolved (``kv_cache_utils.get_none_hash_seed()``) once it has."""
    env_seed = os.environ.get("PYTHONHASHSEED")
    if algo in _NON_CRYPTO_ALGOS and env_seed is None:
        return (
            f"prefix_caching_hash_algo={algo} seeds vLLM's block hashes with random bytes per "
            "process, so no other vLLM instance (nor this one after a restart) could ever "
            "match a chunk kvstrata stores; use the default --prefix-caching-hash-algo sha256 "
            "(or sha256_cbor), or set the same PYTHONHASHSEED for every instance"
        )
    from_default = seed is None or seed == "vllm-none-hash"
    if not from_default and seed != env_seed:
        return (
            "vLLM seeded its block hashes with random per-process bytes (a non-cryptographic "
            "prefix_caching_hash_algo without PYTHONHASHSEED), so no other instance could ever "
            "match a chunk kvstrata stores; use --prefix-caching-hash-algo sha256 or set "
            "PYTHONHASHSEED to one value for every instance"
        )
    return None
