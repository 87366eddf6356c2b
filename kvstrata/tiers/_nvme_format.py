"""On-disk format of one NVMe chunk file or slab slot: a 4096-byte header, then the payload.

Layout (little-endian; byte offsets into the file):

====== ===== ===============================================================
offset bytes field
====== ===== ===============================================================
0      8     magic ``KVSTRAT1``
8      2     format version (1)
10     2     header length = payload offset (4096)
12     4     flags (0: a chunk file; 1: a slot of a slab file, ``_nvme_slabs``)
16     8     payload length
24     8     tokens
32     16    payload checksum (xxh3-128)
48     2     namespace length (1-256)
50     1     hash length (1-64)
51     1     parent length (0-64)
52     1     codec length (1-255)
53     3     zero
56     8     written at (Unix time, ns)
64     …     namespace, hash, parent, codec bytes, back to back
…      …     zero padding
4064   8     generation (slots: orders two copies of one chunk; 0 in chunk files)
4072   8     zero
4080   16    header checksum: xxh3-128 of bytes 0-4079
4096   n     payload
====== ===== ===============================================================

A file is named ``{d[:2]}/{d}.kvc`` with ``d = sha256("kvstrata-nvme\\0" || le_u16(len(ns)) ||
ns || hash)`` in hex: names come only from a digest, never from client strings. The header
repeats the namespace and hash, so a file found under the wrong name is detected. A slot of a
slab file has the same header at the slot's offset and its payload 4096 bytes further, so
every reader (POSIX, kvikio, ``gpu_nvme``) reads both layouts the same way from an offset.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time
from dataclasses import dataclass

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.tiers.checksum import checksum

MAGIC = b"KVSTRAT1"
VERSION = 1
HEADER_SIZE = 4096
SUFFIX = ".kvc"
TMP_SUFFIX = ".tmp"
_FIXED = struct.Struct("<8sHHIQQ16sHBBB3xQ")
_CSUM_AT = HEADER_SIZE - 16
_GEN_AT = HEADER_SIZE - 32
FLAG_SLOT = 1


class BadHeader(ValueError):
    """The first 4096 bytes are not a valid kvstrata chunk header (the message says why)."""


@dataclass(frozen=True, slots=True)
class Header:
    meta: ChunkMeta
    written_ns: int
    flags: int = 0
    generation: int = 0


class WriteClock:
    """The "written at" of new headers: the wall clock, but always above every time given
    out before or found on disk at start (:meth:`at_least`), so that of two copies of one
    chunk left by a crash the later write has the later time even if the clock stepped back."""

    def __init__(self) -> None:
        self._last = 0
        self._lock = threading.Lock()

    def now(self) -> int:
        with self._lock:
            self._last = max(time.time_ns(), self._last + 1)
            return self._last

    def at_least(self, ns: int) -> None:
        with self._lock:
            self._last = max(self._last, ns)


def chunk_digest(key: ChunkKey) -> str:
    ns = key.namespace.encode("ascii")
    h = hashlib.sha256(b"kvstrata-nvme\0")
    h.update(len(ns).to_bytes(2, "little"))
    h.update(ns)
    h.update(key.hash)
    return h.hexdigest()


def chunk_relpath(key: ChunkKey) -> str:
    """``ab/ab…(64 hex).kvc`` relative to the tier folder."""
    d = chunk_digest(key)
    return f"{d[:2]}/{d}{SUFFIX}"


def file_bytes(payload: int) -> int:
    """Disk space a chunk file takes with 4 KiB blocks: header plus payload rounded up."""
    return HEADER_SIZE + (payload + 4095) // 4096 * 4096


def encode_header(
    meta: ChunkMeta, payload_checksum: bytes, written_ns: int, generation: int = 0
) -> bytes:
    """The header block; a ``generation`` > 0 marks a slot of a slab file (``FLAG_SLOT``)."""
    ns = meta.key.namespace.encode("ascii")
    codec = meta.codec.encode("ascii")
    if not (1 <= len(ns) <= 256 and 1 <= len(meta.key.hash) <= 64 and len(meta.parent) <= 64):
        raise ValueError("namespace, hash or parent out of range for the chunk header")
    if not 1 <= len(codec) <= 255:
        raise ValueError(f"codec name of {len(codec)} bytes does not fit the chunk header")
    block = bytearray(HEADER_SIZE)
    _FIXED.pack_into(
        block, 0, MAGIC, VERSION, HEADER_SIZE, FLAG_SLOT if generation else 0, meta.size,
        meta.tokens, payload_checksum,
        len(ns), len(meta.key.hash), len(meta.parent), len(codec), written_ns,
    )  # fmt: skip
    tail = ns + meta.key.hash + meta.parent + codec
    block[_FIXED.size : _FIXED.size + len(tail)] = tail
    block[_GEN_AT : _GEN_AT + 8] = generation.to_bytes(8, "little")
    block[_CSUM_AT:] = checksum(memoryview(block)[:_CSUM_AT])
    return bytes(block)


def decode_header(block: bytes | bytearray | memoryview) -> Header:
    """Parse and verify a header block; raises :class:`BadHeader`."""
    if len(block) < HEADER_SIZE:
        raise BadHeader(f"truncated header ({len(block)} bytes)")
    view = memoryview(block)[:HEADER_SIZE]
    if bytes(view[:8]) != MAGIC:
        raise BadHeader("not a kvstrata chunk file (bad magic)")
    fields = _FIXED.unpack_from(view, 0)
    _, version, hlen, flags, size, tokens, csum, ns_len, h_len, p_len, c_len, written = fields
    if version != VERSION or hlen != HEADER_SIZE:
        raise BadHeader(f"unsupported format version {version} / header length {hlen}")
    if checksum(view[:_CSUM_AT]) != bytes(view[_CSUM_AT:]):
        raise BadHeader("header checksum mismatch")
    pos = _FIXED.size
    raw = bytes(view[pos : pos + ns_len + h_len + p_len + c_len])
    try:
        ns = raw[:ns_len].decode("ascii")
        codec = raw[ns_len + h_len + p_len :].decode("ascii")
    except UnicodeDecodeError:
        raise BadHeader("namespace or codec is not ASCII") from None
    if not ns or not h_len or not codec:
        raise BadHeader("empty namespace, hash or codec")
    key = ChunkKey(ns, raw[ns_len : ns_len + h_len])
    parent = raw[ns_len + h_len : ns_len + h_len + p_len]
    generation = int.from_bytes(view[_GEN_AT : _GEN_AT + 8], "little")
    return Header(ChunkMeta(key, parent, tokens, size, csum, codec), written, flags, generation)
