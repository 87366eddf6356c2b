"""Entropy coders of one byte stream: static rANS (C, :mod:`kvstrata.codecs._rans`), zstd (the
optional ``zstandard`` package) and stored.

rANS tables are 12-bit frequencies of the stream's own histogram, written beside the stream
as ``u16 n`` then ``n × (u8 symbol, u16 frequency)`` (a few dozen bytes for an exponent plane,
at most 770). Every decoder checks its input: a table that does not sum to 4096, a stream
that ends early or leaves words over, or a zstd frame of another length raises
:class:`CodecError`, whatever the bytes.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from kvstrata.codecs.errors import CodecError

_rans: Any
try:
    from kvstrata.codecs import _rans  # type: ignore[attr-defined,no-redef]
except ImportError:  # pragma: no cover - built by setup.py; absent without a compiler
    _rans = None

try:
    import zstandard
except ImportError:  # pragma: no cover - the optional [codecs] extra
    zstandard = None  # type: ignore[assignment]

Buffer = bytes | bytearray | memoryview

CODER_RAW, CODER_RANS, CODER_ZSTD = 0, 1, 2
CODER_NAMES = {CODER_RAW: "raw", CODER_RANS: "rans", CODER_ZSTD: "zstd"}
SCALE_BITS = 12
SCALE = 1 << SCALE_BITS
ZSTD_LEVEL = 1
_ENTRY = struct.Struct("<BH")


def have_rans() -> bool:
    return _rans is not None


def have_zstd() -> bool:
    return zstandard is not None


def histogram(data: Buffer) -> np.ndarray:
    """Counts of each byte value (int64[256])."""
    if _rans is not None:
        return np.frombuffer(_rans.histogram(data), dtype="<u8").astype(np.int64)
    return np.bincount(np.frombuffer(data, dtype=np.uint8), minlength=256).astype(np.int64)


def normalize(counts: np.ndarray) -> np.ndarray:
    """12-bit frequencies (sum 4096) of a histogram: every present symbol keeps at least 1."""
    total = int(counts.sum())
    if total == 0:
        raise ValueError("cannot build a table for an empty stream")
    freq = np.where(counts > 0, np.maximum(1, counts * SCALE // total), 0).astype(np.int64)
    # Hand out what flooring left (or take back what the minimum of 1 added), largest first.
    order = np.argsort(-counts, kind="stable")
    diff = SCALE - int(freq.sum())
    if diff > 0:
        freq[order[0]] += diff
    while diff < 0:
        for s in order:
            if diff == 0:
                break
            if freq[s] > 1:
                freq[s] -= 1
                diff += 1
    return freq


def pack_table(freq: np.ndarray) -> bytes:
    syms = np.flatnonzero(freq)
    return struct.pack("<H", len(syms)) + b"".join(_ENTRY.pack(int(s), int(freq[s])) for s in syms)


def unpack_table(data: Buffer) -> bytes:
    """The 256 × u16 table the C coder takes, from its compact form; checks it."""
    raw = bytes(data)
    if len(raw) < 2:
        raise CodecError("rans table is truncated")
    (n,) = struct.unpack_from("<H", raw)
    if not 1 <= n <= 256 or len(raw) != 2 + n * _ENTRY.size:
        raise CodecError("rans table has a bad length")
    freq = np.zeros(256, dtype="<u2")
    for i in range(n):
        s, f = _ENTRY.unpack_from(raw, 2 + i * _ENTRY.size)
        if f == 0 or freq[s]:
            raise CodecError("rans table repeats a symbol or has a zero frequency")
        freq[s] = f
    if int(freq.sum(dtype=np.int64)) != SCALE:
        raise CodecError("rans table does not sum to 4096")
    return freq.tobytes()


def encode(data: Buffer, coder: int) -> tuple[int, bytes, bytes]:
    """Code one stream: (coder used, table, coded bytes). Falls back to stored when the
    coder is missing here, the stream is empty, or coding does not make it smaller."""
    n = memoryview(data).nbytes
    if n and coder == CODER_RANS and _rans is not None:
        freq = normalize(histogram(data))
        table = pack_table(freq)
        coded = _rans.encode(data, freq.astype("<u2").tobytes())
        if len(coded) + len(table) < n:
            return CODER_RANS, table, coded
    elif n and coder == CODER_ZSTD and zstandard is not None:
        coded = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)
        if len(coded) < n:
            return CODER_ZSTD, b"", coded
    return CODER_RAW, b"", bytes(data)


def decode(coder: int, table: Buffer, coded: Buffer, out: memoryview) -> None:
    """Decode one stream into ``out`` (exactly its decoded length); raises CodecError."""
    if coder == CODER_RAW:
        if memoryview(coded).nbytes != out.nbytes:
            raise CodecError("stored stream has the wrong length")
        out[:] = coded
    elif coder == CODER_RANS:
        if _rans is None:
            raise CodecError("this chunk is rANS-coded: build kvstrata's C extensions to read it")
        try:
            _rans.decode(coded, unpack_table(table), out)
        except ValueError as exc:
            raise CodecError(str(exc)) from None
    elif coder == CODER_ZSTD:
        if zstandard is None:
            raise CodecError("this chunk is zstd-coded: pip install 'kvstrata[codecs]' to read it")
        try:
            got = zstandard.ZstdDecompressor().decompress(coded, max_output_size=out.nbytes)
        except zstandard.ZstdError as exc:
            raise CodecError(f"zstd: {exc}") from None
        if len(got) != out.nbytes:
            raise CodecError("zstd stream decodes to the wrong length")
        out[:] = got
    else:
        raise CodecError(f"unknown coder {coder}")


def split16(data: Buffer, kind: int) -> tuple[bytes, bytes]:
    """Exponent plane and sign+mantissa plane of 16-bit values (kind 0 bf16, 1 fp16)."""
    if _rans is not None:
        a, b = _rans.split16(data, kind)
        return a, b
    v = np.frombuffer(data, dtype="<u2")
    if kind == 0:
        return (((v >> 7) & 0xFF).astype(np.uint8).tobytes(),
                (((v >> 8) & 0x80) | (v & 0x7F)).astype(np.uint8).tobytes())  # fmt: skip
    return (v >> 8).astype(np.uint8).tobytes(), (v & 0xFF).astype(np.uint8).tobytes()


def merge16(a: Buffer, b: Buffer, out: memoryview, kind: int) -> None:
    """The inverse of :func:`split16`, into ``out``."""
    if _rans is not None:
        try:
            _rans.merge16(a, b, out, kind)
        except ValueError as exc:
            raise CodecError(str(exc)) from None
        return
    pa = np.frombuffer(a, dtype=np.uint8).astype(np.uint16)
    pb = np.frombuffer(b, dtype=np.uint8).astype(np.uint16)
    if len(pa) != len(pb) or out.nbytes != 2 * len(pa):
        raise CodecError("merge16: plane lengths do not match the output")
    v = ((pb & 0x80) << 8) | (pa << 7) | (pb & 0x7F) if kind == 0 else (pa << 8) | pb
    out[:] = v.astype("<u2").tobytes()


def split4(data: Buffer) -> bytes:
    """One byte per 4-bit code (low nibble first): the symbols int4e codes, 16 of them, so a
    table costs at most 50 bytes."""
    b = np.frombuffer(data, dtype=np.uint8)
    out = np.empty(2 * len(b), dtype=np.uint8)
    out[0::2] = b & 0x0F
    out[1::2] = b >> 4
    return out.tobytes()


def merge4(nibbles: Buffer, out: memoryview) -> None:
    """The inverse of :func:`split4`, into ``out``; a symbol over 15 is a CodecError."""
    a = np.frombuffer(nibbles, dtype=np.uint8)
    if len(a) != 2 * out.nbytes:
        raise CodecError("merge4: plane length does not match the output")
    if len(a) and int(a.max()) > 0x0F:
        raise CodecError("int4 stream decodes to a symbol over 15")
    np.frombuffer(out, dtype=np.uint8)[:] = a[0::2] | (a[1::2] << 4)
