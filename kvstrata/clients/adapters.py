"""Helpers shared by the engine adapters (``sglang.py``, ``lmcache.py``): namespaces built from an
engine's identity, engine keys hashed to kvstrata chunk hashes, and copies between raw host
pointers (an engine's memory pool) and buffers.

Engines name a page or chunk with strings that can exceed the 64 bytes a chunk hash may have
(SGLang's pool-suffixed page keys, LMCache's ``model@world@worker@hash@dtype@tags``), so the
adapters store ``SHA-256(key)``; the namespace keeps layouts apart (model, dtype, rank…).
"""

from __future__ import annotations

import ctypes
import hashlib
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvstrata.chunks import MAX_NAMESPACE_BYTES

__all__ = ["gather", "key_hash", "namespace_of", "pointer_array", "scatter"]

_UNSAFE = re.compile(r"[^A-Za-z0-9_.:@/+=,#%~^-]")


def namespace_of(parts: Iterable[Any]) -> str:
    """A valid kvstrata namespace from ``parts`` joined by ``@``: characters the server refuses
    become ``_``; a name too long keeps its head and ends in a digest of the whole."""
    ns = _UNSAFE.sub("_", "@".join(str(p) for p in parts if p is not None and p != ""))
    if not ns:
        raise ValueError("empty namespace")
    if len(ns) > MAX_NAMESPACE_BYTES:
        digest = hashlib.sha256(ns.encode()).hexdigest()[:32]
        ns = f"{ns[: MAX_NAMESPACE_BYTES - 33]}~{digest}"
    return ns


def key_hash(key: str) -> bytes:
    """The chunk hash an engine key is stored under (32 bytes)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def pointer_array(ptr: int, nbytes: int) -> np.ndarray:
    """A writable uint8 numpy view of ``nbytes`` of host memory at address ``ptr`` (an engine's
    pinned host pool); valid as long as that memory is."""
    if ptr <= 0 or nbytes < 0:
        raise ValueError(f"invalid host buffer ({ptr:#x}, {nbytes})")
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


def scatter(chunks: Sequence[np.ndarray], pages: list[list[np.ndarray]]) -> int:
    """Copy each chunk into its page's buffers; stops at the first chunk of the wrong size.
    Returns how many pages were filled."""
    for i, chunk in enumerate(chunks):
        bufs = pages[i]
        if chunk.nbytes != sum(b.nbytes for b in bufs):
            return i
        at = 0
        for b in bufs:
            b[:] = chunk[at : at + b.nbytes]
            at += b.nbytes
    return len(chunks)


def gather(bufs: list[np.ndarray], dst: np.ndarray) -> None:
    """Copy ``bufs`` back to back into ``dst``."""
    at = 0
    for b in bufs:
        dst[at : at + b.nbytes] = b
        at += b.nbytes
