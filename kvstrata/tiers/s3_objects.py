"""Object names and user metadata of the S3 tier: how a chunk maps to an S3 object and back.

Object names are ``{prefix}/{namespace}/{first two hex of hash}/{hex hash}``; the namespace is
escaped (``%`` → ``%25``, ``/`` → ``%2F``, and ``.`` in a namespace made only of dots) so it is one
path segment. User metadata (``x-amz-meta-kvs-*``) carries the parent hash, tokens, codec,
xxh3-128 checksum, size and a format version; a reader of another format version sees a miss
and leaves the object alone. No I/O here: :mod:`kvstrata.tiers.s3` does the requests.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import quote, unquote

from kvstrata.protocol.errors import CommandError
from kvstrata.store.keys import ChunkKey, ChunkMeta, validate_namespace
from kvstrata.tiers.checksum import CHECKSUM_BYTES

FORMAT_VERSION = "1"
_M_VERSION, _M_PARENT, _M_TOKENS = "kvs-version", "kvs-parent", "kvs-tokens"
_M_CODEC, _M_CHECKSUM, _M_SIZE = "kvs-codec", "kvs-checksum", "kvs-size"


def _escape_namespace(ns: str) -> str:
    escaped = ns.replace("%", "%25").replace("/", "%2F")
    return escaped.replace(".", "%2E") if escaped.strip(".") == "" else escaped


def object_name(prefix: str, key: ChunkKey) -> str:
    """``{prefix}/{namespace}/{hh}/{hex}`` (no leading prefix segment when prefix is empty)."""
    hexhash = key.hex
    tail = f"{_escape_namespace(key.namespace)}/{hexhash[:2]}/{hexhash}"
    prefix = prefix.strip("/")
    return f"{prefix}/{tail}" if prefix else tail


def parse_object_name(prefix: str, name: str) -> ChunkKey | None:
    """The chunk an object name stands for, or None for names we did not write."""
    prefix = prefix.strip("/")
    head, _, hexhash = name.rpartition("/")
    head = head.rpartition("/")[0]
    if prefix and not head.startswith(prefix + "/"):
        return None
    try:
        ns = validate_namespace(unquote(head[len(prefix) + 1 :] if prefix else head))
        key = ChunkKey(ns, bytes.fromhex(hexhash))
    except (CommandError, ValueError):
        return None
    return key if 1 <= len(key.hash) <= 64 and object_name(prefix, key) == name else None


def encode_metadata(meta: ChunkMeta) -> dict[str, str]:
    return {
        _M_VERSION: FORMAT_VERSION,
        _M_PARENT: meta.parent.hex(),
        _M_TOKENS: str(meta.tokens),
        _M_CODEC: quote(meta.codec, safe=""),
        _M_CHECKSUM: meta.checksum.hex(),
        _M_SIZE: str(meta.size),
    }


class CorruptObject(Exception):
    """An object under our names whose metadata or bytes are not what we wrote."""


def decode_metadata(key: ChunkKey, md: Mapping[str, str], length: int) -> ChunkMeta | None:
    """ChunkMeta from user metadata; None for another format version; raises CorruptObject."""
    version = md.get(_M_VERSION)
    if version is None:
        raise CorruptObject("no kvstrata metadata")
    if version != FORMAT_VERSION:
        return None
    try:
        size, tokens = int(md[_M_SIZE]), int(md[_M_TOKENS])
        parent, digest = bytes.fromhex(md[_M_PARENT]), bytes.fromhex(md[_M_CHECKSUM])
        codec = unquote(md[_M_CODEC])
    except (KeyError, ValueError) as exc:
        raise CorruptObject(f"bad metadata: {exc!r}") from None
    if size != length or tokens < 0 or len(digest) != CHECKSUM_BYTES:
        raise CorruptObject(f"metadata says {size} bytes, object has {length}")
    return ChunkMeta(key, parent, tokens, size, digest, codec)
