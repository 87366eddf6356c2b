"""Copy bytes into a slot and checksum them in one pass: the digest a zero-copy writer sends
with ``KV.COMMIT … DIGEST`` so that the server need not hash the slot again.

The C helper (``_copysum.c``, built by ``setup.py``) copies in blocks that stay in the CPU cache
and hashes each right after copying it, so the hash reads no memory: a put costs about one
memcpy. Its x86 loop aligns the destination and loads the source unaligned (memcpy loses up
to a third when the two differ in alignment), and from 512 KiB on writes the slot with
streaming stores and hashes each block from the source, which the copy has just cached.
Without a compiler the Python twin does the same block by block (slower per block, the same
digest). The digest is xxh3-128, the server's chunk checksum (``tiers.checksum``).
"""

from __future__ import annotations

from typing import Any

import xxhash

try:
    from kvstrata.clients._copysum import copy_checksum as _c_copy_checksum
except ImportError:  # no compiler at install: the Python twin
    _c_copy_checksum = None

__all__ = ["COMPILED", "copy_checksum"]

#: True when the compiled helper is in use
COMPILED = _c_copy_checksum is not None
_BLOCK = 256 * 1024


def _py_copy_checksum(dst: memoryview, src: memoryview) -> bytes:
    if dst.nbytes != src.nbytes:
        raise ValueError(
            f"copy_checksum: {src.nbytes} bytes do not fill a {dst.nbytes}-byte buffer"
        )
    state = xxhash.xxh3_128()
    for off in range(0, dst.nbytes, _BLOCK):
        end = min(off + _BLOCK, dst.nbytes)
        dst[off:end] = src[off:end]
        state.update(dst[off:end])
    return state.digest()


def copy_checksum(dst: memoryview, src: Any) -> bytes:
    """Copy ``src`` (a C-contiguous bytes-like object of ``dst``'s length) into the writable
    byte view ``dst``; return the xxh3-128 digest of the bytes (16 bytes, as
    ``xxhash.xxh3_128_digest``). Raises ValueError when the lengths differ."""
    if _c_copy_checksum is not None:
        return _c_copy_checksum(dst, src)
    return _py_copy_checksum(dst, memoryview(src).cast("B"))
