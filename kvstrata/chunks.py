"""Chunk identity shared by the store, the tiers and the clients.

This module sits below both layers that use it: the store and the tiers import it, and it
imports nothing of theirs (only ``protocol.errors``, for the ``ERR`` its validation raises). A
chunk is named by its namespace (one KV layout: model, dtype, TP rank, chunk size, codec)
and its hash (opaque bytes, 1–64). These types are frozen so they can key dictionaries.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvstrata.protocol.errors import CommandError

MAX_NAMESPACE_BYTES = 256
MAX_HASH_BYTES = 64
KEY_PREFIX = b"kv:"

# Printable ASCII without spaces, quotes, glob metacharacters or backslash: safe in logs, in
# `SCAN MATCH kv:{ns}:*` patterns and inside a key. Never used to build a path.
_NAMESPACE_RE = re.compile(rb"[A-Za-z0-9_.:@/+=,#%~^-]{1,256}")


@dataclass(frozen=True, slots=True)
class ChunkKey:
    """One chunk: a namespace and an opaque hash."""

    namespace: str
    hash: bytes

    @property
    def hex(self) -> str:
        return self.hash.hex()

    def redis_key(self) -> bytes:
        """The chunk's name in the keyspace: ``kv:{namespace}:{hex hash}``."""
        return KEY_PREFIX + self.namespace.encode("ascii") + b":" + self.hash.hex().encode()

    @classmethod
    def from_redis_key(cls, key: bytes) -> ChunkKey | None:
        """Parse ``kv:{namespace}:{hex}``; None when the key does not name a chunk."""
        if not key.startswith(KEY_PREFIX):
            return None
        ns, sep, hexpart = key[len(KEY_PREFIX) :].rpartition(b":")
        if not sep or not _NAMESPACE_RE.fullmatch(ns):
            return None
        try:
            digest = bytes.fromhex(hexpart.decode("ascii"))
        except ValueError:
            return None
        if not 1 <= len(digest) <= MAX_HASH_BYTES or hexpart != hexpart.lower():
            return None
        return cls(ns.decode("ascii"), digest)


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    """What every tier stores beside a chunk's bytes."""

    key: ChunkKey
    parent: bytes  # b"" for the first chunk of a chain
    tokens: int
    size: int
    checksum: bytes  # xxh3-128 digest of the payload, 16 bytes
    codec: str = "raw"


def validate_namespace(raw: bytes | bytearray | memoryview | str) -> str:
    """Return the namespace as str, or raise an ``ERR`` naming what is wrong."""
    data = raw.encode("utf-8") if isinstance(raw, str) else bytes(raw)
    if not data:
        raise CommandError("invalid namespace: empty")
    if len(data) > MAX_NAMESPACE_BYTES:
        raise CommandError(f"invalid namespace: longer than {MAX_NAMESPACE_BYTES} bytes")
    if not _NAMESPACE_RE.fullmatch(data):
        raise CommandError(
            "invalid namespace: use letters, digits and _ . : @ / + = , # % ~ ^ - only"
        )
    return data.decode("ascii")


def validate_hash(raw: bytes | bytearray | memoryview, what: str = "hash") -> bytes:
    """Return the hash as bytes (1–64 bytes), or raise an ``ERR``."""
    data = bytes(raw)
    if not 1 <= len(data) <= MAX_HASH_BYTES:
        raise CommandError(f"invalid {what}: must be 1 to {MAX_HASH_BYTES} bytes, got {len(data)}")
    return data


def validate_parent(raw: bytes | bytearray | memoryview, hash: bytes | None = None) -> bytes:
    """A parent is empty (first chunk) or a valid hash other than the chunk's own."""
    data = bytes(raw)
    if not data:
        return b""
    if hash is not None and data == hash:
        raise CommandError("invalid parent: a chunk cannot be its own parent")
    return validate_hash(data, "parent")


MAX_TOKENS = 2**31 - 1
MAX_CODEC_BYTES = 255
_CODEC_RE = re.compile(r"[ -~]{1,255}")  # printable ASCII: what every tier's header holds


def validate_tokens(value: int) -> int:
    """The number of tokens a chunk covers: 0 to 2**31 - 1 (``TOKENS`` of KV.PUT)."""
    if not 0 <= value <= MAX_TOKENS:
        raise CommandError(f"invalid TOKENS: must be 0 to {MAX_TOKENS}, got {value}")
    return value


def validate_codec(name: str) -> str:
    """A codec name: 1–255 printable ASCII characters."""
    if not _CODEC_RE.fullmatch(name):
        raise CommandError(
            f"invalid codec: 1 to {MAX_CODEC_BYTES} printable ASCII characters (got "
            f"{len(name)} characters)"
        )
    return name


def validate_meta(meta: ChunkMeta) -> ChunkMeta:
    """Check every field of a chunk's metadata with the rules a client write (KV.PUT) is held
    to; raise the same ``ERR``. Used for metadata that comes from outside (the shared tier)."""
    key = meta.key
    validate_namespace(key.namespace)
    validate_hash(key.hash)
    validate_parent(meta.parent, key.hash)
    validate_tokens(meta.tokens)
    validate_codec(meta.codec)
    if meta.size < 1:
        raise CommandError("invalid payload: empty")
    return meta
