"""Object names and user metadata of the S3 tier: how a chunk maps to an S3 object and back.

Object names are ``{prefix}/{namespace}/{first two hex of hash}/{hex hash}``; the namespace is
escaped (``%`` → ``%25``, ``/`` → ``%2F``, and ``.`` in a namespace made only of dots) so it is one
path segment. User metadata (``x-amz-meta-kvs-*``) carries the parent hash, tokens, codec,
xxh3-128 checksum, size and a format version; a reader of another format version sees a miss
and leaves the object alone. An object coded by the tier (``s3-codec``) is of format version
2 and also carries ``kvs-encoding`` (the codec of :mod:`kvstrata.codecs`) and
``kvs-stored-size`` (its length); ``kvs-size`` and ``kvs-checksum`` stay those of the chunk as
it was put, checked after decoding, and with ``s3-auth-key`` the encoding is under both tags.
No I/O here: :mod:`kvstrata.tiers.s3` does the requests.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote, unquote

from kvstrata.chunks import (
    ChunkKey,
    ChunkMeta,
    validate_hash,
    validate_meta,
    validate_namespace,
)
from kvstrata.codecs.container import CODECS as CODED_FORMATS
from kvstrata.protocol.errors import CommandError
from kvstrata.tiers.checksum import CHECKSUM_BYTES
from kvstrata.tiers.s3_auth import TAG_BYTES, ObjectAuth

FORMAT_VERSION = "1"
CODED_VERSION = "2"  # an object the tier coded (kvs-encoding); version 1 readers skip it
_M_ENCODING, _M_STORED = "kvs-encoding", "kvs-stored-size"
_M_VERSION, _M_PARENT, _M_TOKENS = "kvs-version", "kvs-parent", "kvs-tokens"
_M_CODEC, _M_CHECKSUM, _M_SIZE = "kvs-codec", "kvs-checksum", "kvs-size"
_M_TAG, _M_META_TAG, _M_KIND = "kvs-tag", "kvs-meta-tag", "kvs-kind"
SESSIONS = "sessions"
MAX_SESSION_BODY = 4096
MAX_SESSION_ID_BYTES = 256  # a session id (KV.SESSION's limit); a tail hash is at most 64


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


def mac_version(encoding: str | None) -> str:
    """The version field the tags cover: ``1``, or ``2:{encoding}`` for a coded object."""
    return FORMAT_VERSION if encoding is None else f"{CODED_VERSION}:{encoding}"


def encode_metadata(
    meta: ChunkMeta,
    tag: bytes | None = None,
    auth: ObjectAuth | None = None,
    encoding: str | None = None,
    stored: int = 0,
) -> dict[str, str]:
    """User metadata of a chunk object; with ``auth``, ``tag`` is its payload tag. A coded
    object (``encoding``) has ``stored`` bytes."""
    md = {
        _M_VERSION: FORMAT_VERSION if encoding is None else CODED_VERSION,
        _M_PARENT: meta.parent.hex(),
        _M_TOKENS: str(meta.tokens),
        _M_CODEC: quote(meta.codec, safe=""),
        _M_CHECKSUM: meta.checksum.hex(),
        _M_SIZE: str(meta.size),
    }
    if encoding is not None:
        md[_M_ENCODING], md[_M_STORED] = encoding, str(stored)
    if auth is not None and tag is not None:
        md[_M_TAG] = tag.hex()
        md[_M_META_TAG] = auth.meta_tag(mac_version(encoding), meta, tag).hex()
    return md


def object_encoding(md: Mapping[str, str]) -> str | None:
    """The codec of a coded object (None: stored as put); call after :func:`decode_metadata`
    accepted ``md``."""
    return md[_M_ENCODING] if md.get(_M_VERSION) == CODED_VERSION else None


class CorruptObject(Exception):
    """An object whose own bytes disagree with its own metadata (it may be deleted: that
    version only)."""


class InvalidObject(Exception):
    """An object under our names whose metadata a client write could not have produced (no
    metadata, malformed fields, a parent equal to its hash…): a miss, left in the bucket."""


class AuthFailure(Exception):
    """An object without valid tags under ``s3-auth-key``: a miss, left in the bucket."""


def decode_metadata(key: ChunkKey, md: Mapping[str, str], length: int) -> ChunkMeta | None:
    """ChunkMeta from user metadata; None for another format version; raises InvalidObject."""
    version = md.get(_M_VERSION)
    if version is None:
        raise InvalidObject("no kvstrata metadata")
    if version not in (FORMAT_VERSION, CODED_VERSION):
        return None
    try:
        size, tokens = _decimal(md[_M_SIZE]), _decimal(md[_M_TOKENS])
        stored = size if version == FORMAT_VERSION else _decimal(md[_M_STORED])
        if version == CODED_VERSION and md[_M_ENCODING] not in CODED_FORMATS:
            raise ValueError(f"unknown kvs-encoding {md[_M_ENCODING][:24]!r}")
        parent, digest = bytes.fromhex(md[_M_PARENT]), bytes.fromhex(md[_M_CHECKSUM])
        codec = unquote(md[_M_CODEC], errors="strict")
    except (KeyError, ValueError) as exc:
        raise InvalidObject(f"bad metadata: {exc!r}") from None
    if len(digest) != CHECKSUM_BYTES:
        raise InvalidObject(f"checksum of {len(digest)} bytes")
    if stored != length:
        raise InvalidObject(f"metadata says {stored} bytes, object has {length}")
    if version == CODED_VERSION and not 0 < stored < size:
        raise InvalidObject(f"coded object of {stored} bytes for a chunk of {size}")
    try:
        return validate_meta(ChunkMeta(key, parent, tokens, size, digest, codec))
    except CommandError as exc:
        raise InvalidObject(str(exc)) from None


def _decimal(text: str) -> int:
    """A number as ``str(int)`` writes it: ``int()`` alone also takes ``+4``, ``1_000``, spaces
    and non-ASCII digits, which no kvstrata writer produces (range checks follow)."""
    if not (text.isascii() and text.isdigit() and len(text) <= 20):
        raise ValueError(f"{text[:24]!r} is not a decimal number")
    return int(text)


def payload_tag(md: Mapping[str, str], meta: ChunkMeta, auth: ObjectAuth) -> bytes:
    """The object's payload tag once its metadata tag verified; raises AuthFailure."""
    try:
        tag, meta_tag = bytes.fromhex(md[_M_TAG]), bytes.fromhex(md[_M_META_TAG])
    except (KeyError, ValueError):
        raise AuthFailure("no valid tags") from None
    want = auth.meta_tag(mac_version(object_encoding(md)), meta, tag)
    if len(tag) != TAG_BYTES or not auth.same(meta_tag, want):
        raise AuthFailure("metadata tag does not verify")
    return tag


# -- sessions ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SessionObject:
    """Where a session's conversation ends (``KV.SESSION``), as other nodes read it."""

    namespace: str
    id: bytes
    tail: bytes
    expires_ms: int  # wall clock (Unix ms): nodes do not share a monotonic clock

    def ttl_ms(self, now_ms: int | None = None) -> int:
        now = int(time.time() * 1000) if now_ms is None else now_ms
        return self.expires_ms - now


def session_name(prefix: str, ns: str, session: bytes) -> str:
    tail = f"{_escape_namespace(ns)}/{SESSIONS}/{session.hex()}"
    prefix = prefix.strip("/")
    return f"{prefix}/{tail}" if prefix else tail


def encode_session(obj: SessionObject) -> bytes:
    return json.dumps({
        "format": int(FORMAT_VERSION), "namespace": obj.namespace, "session": obj.id.hex(),
        "tail": obj.tail.hex(), "expires_ms": obj.expires_ms,
    }, separators=(",", ":")).encode()  # fmt: skip


def decode_session(
    ns: str, session: bytes, body: bytes, max_ttl_ms: int, now_ms: int | None = None
) -> SessionObject:
    """The session object, every field checked as a KV.SESSION is; raises InvalidObject.

    The bucket is untrusted: a field of the wrong JSON type (a float, ``NaN``, ``true`` for 1,
    a string for a number), a hash of the wrong length or an expiry a KV.SESSION could not
    have set (negative, or more than ``max_ttl_ms`` ahead of ``now_ms``: a 400-digit integer
    used to reach the session table and fail there with OverflowError) is invalid. An expiry
    in the past is valid (an expired session, which the caller treats as absent)."""
    try:
        doc = json.loads(body)
        fmt, obj_ns, expires = doc["format"], doc["namespace"], doc["expires_ms"]
        sid, tail = _hex_field(doc, "session"), validate_hash(_hex_field(doc, "tail"))
    except (ValueError, KeyError, TypeError, RecursionError, CommandError) as exc:
        raise InvalidObject(f"bad session object: {type(exc).__name__}") from None
    if type(fmt) is not int or fmt != int(FORMAT_VERSION):
        raise InvalidObject("session object of another format")
    if type(obj_ns) is not str or obj_ns != ns or sid != session:
        raise InvalidObject("session object of another session or namespace")
    if type(expires) is not int:  # bool is a subclass of int; floats (NaN too) are refused
        raise InvalidObject(f"session expires_ms is a {type(expires).__name__}, not an integer")
    now = int(time.time() * 1000) if now_ms is None else now_ms
    if not 0 <= expires <= now + max_ttl_ms:
        raise InvalidObject("session expires_ms out of range")
    return SessionObject(ns, session, tail, expires)


def _hex_field(doc: Mapping[str, object], name: str) -> bytes:
    """A hex string field (a session id or a hash), refused before decoding when it is not a
    string or longer than any session id."""
    value = doc[name]
    if type(value) is not str or len(value) > 2 * MAX_SESSION_ID_BYTES:
        raise TypeError(name)
    return bytes.fromhex(value)


def session_metadata(tag: bytes | None) -> dict[str, str]:
    md = {_M_VERSION: FORMAT_VERSION, _M_KIND: "session"}
    if tag is not None:
        md[_M_TAG] = tag.hex()
    return md


def check_session_tag(md: Mapping[str, str], name: str, body: bytes, auth: ObjectAuth) -> None:
    try:
        tag = bytes.fromhex(md[_M_TAG])
    except (KeyError, ValueError):
        raise AuthFailure("no valid tag") from None
    if not auth.same(tag, auth.session_tag(name, body)):
        raise AuthFailure("session tag does not verify")
