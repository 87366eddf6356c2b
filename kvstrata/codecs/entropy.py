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


MODE_BYTES, MODE_NIB4, MODE_BF16, MODE_FP16 = 0, 1, 2, 3
_SPLIT = {MODE_BF16: 0, MODE_FP16: 1}


def histogram(data: Buffer, mode: int = MODE_BYTES) -> np.ndarray:
    """Counts of each symbol (int64[256]) of ``data`` read in ``mode``."""
    if _rans is not None:
        return np.frombuffer(_rans.histogram(data, mode), dtype="<u8").astype(np.int64)
    if mode != MODE_BYTES:
        raise CodecError("symbol modes need the C extension")
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


def symbols_len(out_len: int, mode: int) -> int:
    """Symbols a rANS stream of a segment of ``out_len`` bytes holds."""
    return 2 * out_len if mode == MODE_NIB4 else out_len // 2 if mode in _SPLIT else out_len


def plane_len(out_len: int, mode: int) -> int:
    """Bytes of the stream a stored or zstd segment holds: the exponent (or high byte) plane
    of 16-bit modes, the bytes themselves otherwise."""
    return out_len // 2 if mode in _SPLIT else out_len


def encode(data: Buffer, coder: int, mode: int = MODE_BYTES) -> tuple[int, bytes, Buffer]:
    """Code one segment's stream: (coder used, table, coded bytes). rANS codes the symbols of
    ``mode``; zstd and stored hold :func:`plane_len` bytes (the exponent plane of a 16-bit
    mode, the segment's bytes otherwise). Stored where the coder is missing here, the stream
    is empty, or coding does not make it smaller."""
    n = memoryview(data).nbytes
    plane: Buffer = split16(data, _SPLIT[mode])[0] if mode in _SPLIT else data
    if n and coder == CODER_RANS and _rans is not None:
        freq = normalize(histogram(data, mode))
        table = pack_table(freq)
        coded = _rans.encode(data, freq.astype("<u2").tobytes(), mode)
        if len(coded) + len(table) < plane_len(n, mode):
            return CODER_RANS, table, coded
    elif n and coder == CODER_ZSTD and zstandard is not None:
        coded = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(plane)
        if len(coded) < plane_len(n, mode):
            return CODER_ZSTD, b"", coded
    return CODER_RAW, b"", plane


def decode(coder: int, table: Buffer, coded: Buffer, out: memoryview, mode: int = MODE_BYTES,
           plane: Buffer | None = None) -> None:  # fmt: skip
    """Decode one segment into ``out`` (exactly its length); ``plane`` is the raw plane of a
    16-bit mode. Raises CodecError."""
    if coder == CODER_RANS:
        if _rans is None:
            raise CodecError("this chunk is rANS-coded: build kvstrata's C extensions to read it")
        try:
            if plane is None:
                _rans.decode(coded, unpack_table(table), out, mode)
            else:
                _rans.decode(coded, unpack_table(table), out, mode, plane)
        except ValueError as exc:
            raise CodecError(str(exc)) from None
        return
    want = plane_len(out.nbytes, mode)
    if coder == CODER_RAW:
        got: Buffer = coded
    elif coder == CODER_ZSTD:
        if zstandard is None:
            raise CodecError("this chunk is zstd-coded: pip install 'kvstrata[codecs]' to read it")
        try:
            got = zstandard.ZstdDecompressor().decompress(coded, max_output_size=want)
        except zstandard.ZstdError as exc:
            raise CodecError(f"zstd: {exc}") from None
    else:
        raise CodecError(f"unknown coder {coder}")
    if memoryview(got).nbytes != want:
        raise CodecError("stream decodes to the wrong length")
    if mode in _SPLIT:
        merge16(got, plane if plane is not None else b"", out, _SPLIT[mode])
    else:
        out[:] = got


_DIR = struct.Struct("<HI")  # per plane: table length (0: stored), coded length


def encode_planes(data: Buffer, k: int) -> tuple[int, bytes, bytes]:
    """rANS-code the ``k`` byte planes of ``k``-byte elements (float scales and zero points)
    each with its own table: (coder, table area, coded area). The table area is ``k`` ×
    (u16 table length, u32 coded length) then the tables; a plane coding does not shrink is
    stored (table length 0). Stored as a whole when that is not smaller."""
    n = memoryview(data).nbytes
    if _rans is None or n == 0 or n % k:
        return CODER_RAW, b"", bytes(data)
    planes = np.frombuffer(data, dtype=np.uint8).reshape(-1, k).T
    heads, tables, streams = [], [], []
    for plane in planes:
        raw = plane.tobytes()
        used, table, coded = encode(raw, CODER_RANS)
        if used != CODER_RANS:
            table, coded = b"", raw
        heads.append(_DIR.pack(len(table), len(coded)))
        tables.append(table)
        streams.append(bytes(coded))
    table_area, coded_area = b"".join(heads + tables), b"".join(streams)
    if len(table_area) + len(coded_area) >= n:
        return CODER_RAW, b"", bytes(data)
    return CODER_RANS, table_area, coded_area


def decode_planes(table_area: Buffer, coded_area: Buffer, out: memoryview, k: int) -> None:
    """The inverse of :func:`encode_planes` for a rANS-coded segment; raises CodecError."""
    tables, coded = memoryview(table_area), memoryview(coded_area)
    if out.nbytes % k or tables.nbytes < k * _DIR.size:
        raise CodecError("plane directory is truncated")
    per = out.nbytes // k
    dst = np.frombuffer(out, dtype=np.uint8).reshape(-1, k)
    tpos, cpos = k * _DIR.size, 0
    for i in range(k):
        tlen, clen = _DIR.unpack_from(tables, i * _DIR.size)
        if tpos + tlen > tables.nbytes or cpos + clen > coded.nbytes:
            raise CodecError("plane directory points past its streams")
        plane = bytearray(per)
        if tlen:
            decode(CODER_RANS, tables[tpos : tpos + tlen], coded[cpos : cpos + clen],
                   memoryview(plane))  # fmt: skip
        elif clen == per:
            plane[:] = coded[cpos : cpos + clen]
        else:
            raise CodecError("stored plane has the wrong length")
        dst[:, i] = np.frombuffer(plane, dtype=np.uint8)
        tpos, cpos = tpos + tlen, cpos + clen
    if tpos != tables.nbytes or cpos != coded.nbytes:
        raise CodecError("plane streams do not fill their segment")


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
