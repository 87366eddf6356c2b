"""Chained chunk hashing: the identity of a chunk of KV cache (see ``docs/hashing.md``).

A prompt is cut into chunks of ``chunk_tokens`` token ids; only full chunks are hashed. Each
chunk's 32-byte SHA-256 digest folds in its parent's digest, so one hash names a whole prefix::

    seed = SHA-256(b"kvstrata-v1\\0" || le_u32(len(ns)) || ns
                   || le_u32(len(extra)) || for each e in extra: le_u32(len(e)) || e)
    h_0  = SHA-256(seed    || le_u32(tokens of chunk 0))
    h_i  = SHA-256(h_{i-1} || le_u32(tokens of chunk i))

``ns`` is the namespace in UTF-8 (printable ASCII in practice); ``le_u32`` packs each value as a
little-endian unsigned 32-bit integer. Both the server (``KV.MATCHTOKENS``) and the clients import
this module, so an engine and the server always agree on a chunk's name.

Token ids may be given as a sequence of ints, as a numpy (or any ``__array__``) integer array,
or already packed as little-endian u32 bytes (what the server receives on the wire), which are
hashed in place without conversion.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "DIGEST_SIZE",
    "DOMAIN",
    "TokenInput",
    "chain_hash",
    "chunk_hashes",
    "pack_tokens",
    "seed",
]

DIGEST_SIZE = 32
#: Domain separator and version of the scheme; a change of scheme changes this string.
DOMAIN = b"kvstrata-v1\x00"
_U32_MAX = 2**32 - 1
_LE_U32 = np.dtype("<u4")

TokenInput = Sequence[int] | bytes | bytearray | memoryview | np.ndarray


def _le_u32(n: int) -> bytes:
    return struct.pack("<I", n)


def _as_bytes(value: bytes | bytearray | memoryview | str, what: str) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"{what} must be bytes or str, not {type(value).__name__}")


def seed(namespace: str | bytes, extra: Iterable[bytes | str] = ()) -> bytes:
    """The 32-byte chain seed of a namespace and its extra keys (LoRA id, salt, media hashes).

    ``str`` values are encoded as UTF-8. Lengths are prefixed so that no two different inputs
    (e.g. ``extra=[b"ab"]`` and ``extra=[b"a", b"b"]``) produce the same seed.
    """
    ns = _as_bytes(namespace, "namespace")
    items = [_as_bytes(e, "extra key") for e in extra]
    h = hashlib.sha256(DOMAIN)
    h.update(_le_u32(len(ns)))
    h.update(ns)
    h.update(_le_u32(len(items)))
    for item in items:
        h.update(_le_u32(len(item)))
        h.update(item)
    return h.digest()


def chain_hash(parent: bytes, packed_chunk: bytes | bytearray | memoryview) -> bytes:
    """One link of the chain: ``SHA-256(parent || packed_chunk)`` (parent is a seed or hash)."""
    h = hashlib.sha256(parent)
    h.update(packed_chunk)
    return h.digest()


def _check_range(arr: np.ndarray) -> None:
    if arr.size == 0:
        return
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > _U32_MAX:
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} is outside [0, 2**32)")


def _pack_array(arr: np.ndarray) -> bytes | memoryview:
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    if arr.dtype == _LE_U32 and arr.flags.c_contiguous:
        return arr.data.cast("B")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, not {arr.dtype}")
    _check_range(arr)
    return arr.astype(_LE_U32).tobytes()


def _packed(tokens: Any) -> bytes | memoryview:
    """Token ids as little-endian u32 bytes (a view when no conversion is needed)."""
    if isinstance(tokens, bytes | bytearray | memoryview):
        view = memoryview(tokens).cast("B")
        if view.nbytes % 4:
            raise ValueError(f"packed tokens must be a multiple of 4 bytes, got {view.nbytes}")
        return view
    if isinstance(tokens, np.ndarray):
        return _pack_array(tokens)
    if hasattr(tokens, "__array__"):
        return _pack_array(np.asarray(tokens))  # torch CPU tensors and similar
    if len(tokens) == 0:
        return b""
    arr = np.array(tokens)
    if arr.dtype == object:  # Python ints beyond int64 (or mixed junk)
        if all(isinstance(t, int) for t in arr.reshape(-1)):
            raise ValueError("a token id is outside [0, 2**32)")
        raise TypeError("token ids must be integers")
    return _pack_array(arr)


def pack_tokens(tokens: TokenInput) -> bytes:
    """Token ids packed as little-endian u32 (the wire form of ``KV.MATCHTOKENS``).

    Raises ``ValueError`` for an id outside ``0 <= t < 2**32`` and ``TypeError`` for
    non-integer input. Packed bytes are returned unchanged (after a length check).
    """
    packed = _packed(tokens)
    return packed if isinstance(packed, bytes) else packed.tobytes()


def chunk_hashes(
    tokens: TokenInput,
    namespace: str | bytes,
    chunk_tokens: int,
    extra: Sequence[bytes | str] = (),
) -> list[bytes]:
    """The chained 32-byte hashes of every full chunk of ``tokens`` (a trailing partial chunk
    is ignored). See the module docstring and ``docs/hashing.md``."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    packed = _packed(tokens)
    view = memoryview(packed)
    step = 4 * chunk_tokens
    count = view.nbytes // step
    out: list[bytes] = []
    prev = seed(namespace, extra)
    sha256 = hashlib.sha256
    for i in range(count):
        h = sha256(prev)
        h.update(view[i * step : (i + 1) * step])
        prev = h.digest()
        out.append(prev)
    return out
