"""Former home of the chunk types, now :mod:`kvstrata.chunks` (below the store and the tiers).

Nothing in kvstrata imports this module; it re-exports the names for branches written before the
move. Import from :mod:`kvstrata.chunks`; a tier must (``tests/test_layering.py``).
"""

from kvstrata.chunks import (
    KEY_PREFIX,
    MAX_CODEC_BYTES,
    MAX_HASH_BYTES,
    MAX_NAMESPACE_BYTES,
    MAX_TOKENS,
    ChunkKey,
    ChunkMeta,
    validate_codec,
    validate_hash,
    validate_meta,
    validate_namespace,
    validate_parent,
    validate_tokens,
)

__all__ = [
    "KEY_PREFIX",
    "MAX_CODEC_BYTES",
    "MAX_HASH_BYTES",
    "MAX_NAMESPACE_BYTES",
    "MAX_TOKENS",
    "ChunkKey",
    "ChunkMeta",
    "validate_codec",
    "validate_hash",
    "validate_meta",
    "validate_namespace",
    "validate_parent",
    "validate_tokens",
]
