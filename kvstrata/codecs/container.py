"""The container of a coded chunk: a versioned binary header, then each segment's streams.

A payload (any bytes; a ``KVST`` payload of :mod:`kvstrata.clients.layout` is split along its
tensors) is cut into *segments* that tile it front to back; each segment is coded on its own
and carries the checksum of its decoded bytes, so one layer's keys can be decoded (and
checked) without touching the rest, and segments decode in parallel. Never pickle: every
field is a fixed-width little-endian integer and is checked before it is used::

    fixed      "KVSX" u16 version u8 codec u8 reserved u32 segments u32 header_len u64 size
    segment    u8 transform u8 coder u16 layer u8 which u8[3] reserved
               u64 out_offset u64 out_len u64 data_offset u32 table_len u32 coded_len
               u64 xxh3-64 of the decoded segment
    trailer    u64 xxh3-64 of everything above (the header's own checksum)
    data       per segment, back to back: table | coded stream | raw plane

Transforms: ``bytes`` (one stream: the segment's bytes), ``nib4`` (its 4-bit codes, one
rANS symbol each), ``planes2``/``planes4`` (the byte planes of 2- or 4-byte elements, one
rANS stream and table each, behind a directory in the table area), ``bf16`` (the coded stream is the
exponent plane, the raw plane is sign and mantissa, one byte each per value), ``fp16`` (high
byte coded, low byte raw). Coders: stored, rANS (static 12-bit table per segment), zstd.

Codecs (all lossless: decoding gives back the payload byte for byte):

``bf16x`` / ``fp16x``  every 16-bit tensor (or, for opaque bytes, every 1 MiB block) split
                       into planes; the exponent plane entropy-coded, mantissas raw.
``int4e``              the 4-bit codes of a ``KVST`` ``int4`` payload rANS-coded, one
                       table per (layer, keys/values); each section of scales or zero points
                       one segment, its byte planes rANS-coded.

:func:`encode` returns None when coding would save less than :data:`MIN_GAIN` of the bytes:
the caller keeps the payload as it is. A malformed, truncated or unknown container raises
:class:`CodecError`; a decode never returns bytes whose checksum did not verify.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

import xxhash

from kvstrata.codecs import entropy, kvst
from kvstrata.codecs.entropy import CODER_RANS, CODER_RAW, CODER_ZSTD
from kvstrata.codecs.errors import CodecError

__all__ = [
    "CODECS",
    "MAGIC",
    "MIN_GAIN",
    "VERSION",
    "Container",
    "decode",
    "decode_into",
    "encode",
    "is_container",
    "read_header",
]

MAGIC = b"KVSX"
VERSION = 1
MIN_GAIN = 0.03  # store raw when coding saves less than this fraction
BLOCK = 1 << 20  # opaque payloads are coded in blocks of this many bytes
_FIXED = struct.Struct("<4sHBBIIQ")
_SEGMENT = struct.Struct("<BBHB3xQQQIIQ")
_TRAILER = struct.Struct("<Q")
T_BYTES, T_BF16, T_FP16, T_NIB4, T_PLANES2, T_PLANES4 = 0, 1, 2, 3, 4, 5
_PLANES = {T_PLANES2: 2, T_PLANES4: 4}
_SPLIT_KIND = {T_BF16: 0, T_FP16: 1}
_MODE = {T_BYTES: entropy.MODE_BYTES, T_BF16: entropy.MODE_BF16, T_FP16: entropy.MODE_FP16,
         T_NIB4: entropy.MODE_NIB4, T_PLANES2: entropy.MODE_BYTES,
         T_PLANES4: entropy.MODE_BYTES}  # fmt: skip
NO_LAYER, NO_WHICH = 0xFFFF, 0xFF

#: codec name → id in the header (never renumber)
CODECS: dict[str, int] = {"bf16x": 1, "fp16x": 2, "int4e": 3}
CODEC_NAMES = {v: k for k, v in CODECS.items()}
_CODER_BY_NAME = {"rans": CODER_RANS, "zstd": CODER_ZSTD}


def default_coder(codec: str) -> str:
    """What :func:`encode` uses unless told: zstd for the exponent planes of ``bf16x``/``fp16x``
    where ``zstandard`` is installed (its Huffman literals decode 3–5× faster than our rANS, at a
    3–4 % lower ratio; docs/benchmarks.md), rANS otherwise and for ``int4e`` (tables per layer
    and keys/values, as the codec promises)."""
    return "zstd" if codec != "int4e" and entropy.have_zstd() else "rans"


Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class Segment:
    transform: int
    coder: int
    layer: int  # NO_LAYER when the segment is not one layer of one tensor
    which: int  # 0 keys, 1 values, NO_WHICH
    out_offset: int
    out_len: int
    data_offset: int
    table_len: int
    coded_len: int
    digest: int  # xxh3-64 of the decoded bytes

    @property
    def raw_len(self) -> int:
        return self.out_len // 2 if self.transform in _SPLIT_KIND else 0

    @property
    def data_len(self) -> int:
        return self.table_len + self.coded_len + self.raw_len


@dataclass(frozen=True, slots=True)
class Container:
    """A parsed, checked header."""

    codec: str
    size: int  # bytes of the decoded payload
    segments: tuple[Segment, ...]

    def layer_segments(self, layer: int, which: int) -> list[int]:
        """Indices of the segments that hold that layer of the keys (0) or values (1)."""
        return [i for i, s in enumerate(self.segments) if s.layer == layer and s.which == which]


def is_container(data: Buffer) -> bool:
    return memoryview(data)[:4] == MAGIC


# -- encoding ------------------------------------------------------------------------------


def _plan(view: memoryview, codec: str) -> Iterator[tuple[int, int, int, int, int]]:
    """(offset, length, transform, layer, which) of segments that tile the payload."""
    layout = kvst.read(view)
    size = view.nbytes
    if codec == "int4e":
        if layout is None or layout.codec != kvst.CODEC_INT4:
            raise CodecError("int4e codes KVST payloads of the int4 codec only")
        wanted, transform = kvst.DTYPE_U8, T_NIB4
    else:
        wanted = kvst.DTYPE_BF16 if codec == "bf16x" else kvst.DTYPE_FP16
        transform = T_BF16 if codec == "bf16x" else T_FP16
        if layout is None or layout.codec != kvst.CODEC_RAW:
            for off in range(0, size - size % 2, BLOCK):
                yield off, min(BLOCK, size - size % 2 - off), transform, NO_LAYER, NO_WHICH
            if size % 2:
                yield size - 1, 1, T_BYTES, NO_LAYER, NO_WHICH
            return
    pos = 0
    for sec in layout.sections:
        data = sec.role == 0 and sec.dtype == wanted
        stats = codec == "int4e" and sec.role != 0  # scales, zero points
        if not (data or stats) or sec.nbytes == 0:
            continue
        if sec.offset > pos:
            yield pos, sec.offset - pos, T_BYTES, NO_LAYER, NO_WHICH
        if stats:
            planes = T_PLANES4 if sec.dtype == kvst.DTYPE_FP32 else T_PLANES2
            yield sec.offset, sec.nbytes, planes, NO_LAYER, sec.which
        else:
            per_layer = sec.nbytes // sec.layers
            for layer in range(sec.layers):
                yield sec.offset + layer * per_layer, per_layer, transform, layer, sec.which
        pos = sec.offset + sec.nbytes
    if pos < size:
        yield pos, size - pos, T_BYTES, NO_LAYER, NO_WHICH


def encode(
    payload: Buffer, codec: str, *, coder: str | None = None, min_gain: float = MIN_GAIN
) -> bytes | None:
    """The container of ``payload`` coded with ``codec`` (``bf16x``, ``fp16x``, ``int4e``),
    or None when that saves less than ``min_gain`` of its size. ``coder``: ``rans`` (the C
    extension) or ``zstd`` (default: :func:`default_coder`); where it is missing the streams
    are stored (and so, usually, the result is None). Raises CodecError for an unknown codec
    or a payload it cannot code."""
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r}; known: {', '.join(CODECS)}")
    coder = coder or default_coder(codec)
    if coder not in _CODER_BY_NAME:
        raise CodecError(f"unknown coder {coder!r}; known: rans, zstd")
    view = memoryview(payload).cast("B")
    entries: list[tuple[int, ...]] = []
    chunks: list[Buffer] = []
    data_len = 0
    for off, length, transform, layer, which in _plan(view, codec):
        part = view[off : off + length]
        raw: Buffer = b""
        coded: Buffer
        if transform == T_BYTES and which == NO_WHICH:  # headers, gaps: stored
            used, table, coded = CODER_RAW, b"", part
        elif transform in _PLANES:  # int4e's scales and zero points: rANS per byte plane
            used, table, coded = entropy.encode_planes(part, _PLANES[transform])
        else:
            used, table, coded = entropy.encode(part, _CODER_BY_NAME[coder], _MODE[transform])
            if transform in _SPLIT_KIND:
                raw = entropy.split16(part, _SPLIT_KIND[transform])[1]
        coded_len = memoryview(coded).nbytes
        entries.append((transform, used, layer, which, off, length, data_len, len(table),
                        coded_len, xxhash.xxh3_64_intdigest(part)))  # fmt: skip
        chunks.extend(c for c in (table, coded, raw) if len(c))
        data_len += len(table) + coded_len + len(raw)
    header_len = _FIXED.size + len(entries) * _SEGMENT.size + _TRAILER.size
    if header_len + data_len > view.nbytes * (1 - min_gain):
        return None
    head = [_FIXED.pack(MAGIC, VERSION, CODECS[codec], 0, len(entries), header_len, view.nbytes)]
    for e in entries:
        head.append(_SEGMENT.pack(*e[:6], header_len + e[6], *e[7:]))
    header = b"".join(head)
    return b"".join([header, _TRAILER.pack(xxhash.xxh3_64_intdigest(header)), *chunks])


# -- decoding ------------------------------------------------------------------------------


def read_header(blob: Buffer) -> Container:
    """Parse and check a container's header (not its data); raises CodecError."""
    view = memoryview(blob).cast("B")
    if view.nbytes < _FIXED.size + _TRAILER.size:
        raise CodecError("coded chunk is shorter than its header")
    magic, version, codec_id, _, count, header_len, size = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise CodecError("not a kvstrata coded chunk (bad magic)")
    if version != VERSION:
        raise CodecError(f"coded chunk version {version} is not supported (this is {VERSION})")
    if codec_id not in CODEC_NAMES:
        raise CodecError(f"unknown codec id {codec_id}")
    if header_len != _FIXED.size + count * _SEGMENT.size + _TRAILER.size:
        raise CodecError("header length does not match its segment count")
    if header_len > view.nbytes:
        raise CodecError("coded chunk is shorter than its header")
    body = view[: header_len - _TRAILER.size]
    (want,) = _TRAILER.unpack_from(view, header_len - _TRAILER.size)
    if xxhash.xxh3_64_intdigest(body) != want:
        raise CodecError("header checksum does not match")
    segments, out_pos, data_pos = [], 0, header_len
    for i in range(count):
        seg = Segment(*_SEGMENT.unpack_from(view, _FIXED.size + i * _SEGMENT.size))
        if seg.transform not in _MODE:
            raise CodecError(f"segment {i}: unknown transform {seg.transform}")
        if seg.transform in _PLANES and (seg.out_len % _PLANES[seg.transform] or
                                         seg.coder == CODER_ZSTD):  # fmt: skip
            raise CodecError(f"segment {i}: a plane segment of a bad length or coder")
        if seg.coder not in entropy.CODER_NAMES:
            raise CodecError(f"segment {i}: unknown coder {seg.coder}")
        if seg.transform in _SPLIT_KIND and seg.out_len % 2:
            raise CodecError(f"segment {i}: odd length for a 16-bit transform")
        if seg.out_offset != out_pos or seg.out_len == 0:
            raise CodecError(f"segment {i}: does not follow the previous one")
        if seg.data_offset != data_pos:
            raise CodecError(f"segment {i}: data offset is not where the previous data ends")
        plain = entropy.plane_len(seg.out_len, _MODE[seg.transform])
        if seg.coder == CODER_RAW and seg.coded_len != plain:
            raise CodecError(f"segment {i}: stored stream has the wrong length")
        if seg.coder != CODER_RANS and seg.table_len:
            raise CodecError(f"segment {i}: a table without a rANS stream")
        out_pos += seg.out_len
        data_pos += seg.data_len
        segments.append(seg)
    if out_pos != size:
        raise CodecError(f"segments cover {out_pos} bytes, the chunk has {size}")
    if data_pos != view.nbytes:
        why = "truncated" if data_pos > view.nbytes else "followed by stray bytes"
        raise CodecError(f"coded chunk is {why} ({view.nbytes} bytes, header says {data_pos})")
    return Container(CODEC_NAMES[codec_id], size, tuple(segments))


def decode_segment(blob: Buffer, seg: Segment, out: memoryview) -> None:
    """Decode one segment into ``out`` (its ``out_len`` bytes) and check its checksum."""
    view = memoryview(blob).cast("B")
    if out.nbytes != seg.out_len:
        raise ValueError(f"output of {out.nbytes} bytes for a segment of {seg.out_len}")
    pos = seg.data_offset
    table = view[pos : pos + seg.table_len]
    pos += seg.table_len
    coded = view[pos : pos + seg.coded_len]
    pos += seg.coded_len
    plane = view[pos : pos + seg.raw_len] if seg.transform in _SPLIT_KIND else None
    if seg.transform in _PLANES and seg.coder == CODER_RANS:
        entropy.decode_planes(table, coded, out, _PLANES[seg.transform])
    else:
        entropy.decode(seg.coder, table, coded, out, _MODE[seg.transform], plane)
    if xxhash.xxh3_64_intdigest(out) != seg.digest:
        raise CodecError(f"segment at {seg.out_offset}: decoded bytes fail their checksum")


def decode_into(blob: Buffer, out: Buffer, header: Container | None = None) -> Container:
    """Decode a whole container into ``out`` (writable, exactly ``size`` bytes)."""
    head = header or read_header(blob)
    dst = memoryview(out).cast("B")
    if dst.nbytes != head.size:
        raise CodecError(f"coded chunk holds {head.size} bytes, the output has {dst.nbytes}")
    for seg in head.segments:
        decode_segment(blob, seg, dst[seg.out_offset : seg.out_offset + seg.out_len])
    return head


def decode(blob: Buffer, max_size: int | None = None) -> bytearray:
    """The payload a container holds; ``max_size`` bounds what a hostile header may ask for."""
    head = read_header(blob)
    if max_size is not None and head.size > max_size:
        raise CodecError(f"coded chunk claims {head.size} bytes, more than {max_size}")
    out = bytearray(head.size)
    decode_into(blob, out, head)
    return out
