"""Tensor layout of one chunk: the KV of every layer in one self-describing payload.

A payload is a header followed by the codec's sections (:mod:`kvstrata.clients.codecs`), each
aligned to 64 bytes so it can be viewed in place as a tensor of its dtype::

    fixed header  "KVST" u16 version u16 header_len u8 codec u8 dtype u16 layers
                  u16 kv_heads u16 head_dim u32 tokens u16 sections u16 reserved
    per section   u8 which (0 keys, 1 values) u8 role u8 dtype u8 ndim u32[4] shape
                  u64 offset u64 nbytes            (offsets from the start of the payload)

All integers are little-endian. Keys and values have the shape ``[layers, kv_heads, tokens,
head_dim]`` in the model's dtype before encoding. :func:`unpack_into` decodes layer by layer
straight into the caller's tensors (typically slices of a preallocated cache), reading the
payload through a view: given a memoryview of a leased shared-memory region it copies the bytes
once, from the region into the cache. :func:`pack_into` writes into a caller's buffer (a
reserved region) the same way.
"""

from __future__ import annotations

import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata import codecs
from kvstrata.clients.codecs import (
    CODECS_BY_CODE,
    DTYPE_IDS,
    DTYPES_BY_ID,
    Codec,
    SectionSpec,
    get_codec,
)

__all__ = [
    "LAYOUT_VERSION",
    "ChunkLayout",
    "LayoutError",
    "pack_chunk",
    "pack_into",
    "packed_size",
    "read_layout",
    "unpack_into",
]

MAGIC = b"KVST"
LAYOUT_VERSION = 1
ALIGN = 64
_FIXED = struct.Struct("<4sHHBBHHHIHH")
_SECTION = struct.Struct("<BBBB4IQQ")
_ROLES = ("data", "scale", "zero")

Buffer = bytes | bytearray | memoryview


class LayoutError(ValueError):
    """A payload is malformed or does not have the layout the caller expects."""


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """What a payload holds: shapes, the model's dtype and the codec."""

    layers: int
    kv_heads: int
    head_dim: int
    tokens: int
    dtype: torch.dtype
    codec: str = "raw"

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Shape of the keys (and of the values) of the whole chunk."""
        return (self.layers, self.kv_heads, self.tokens, self.head_dim)

    def sections(self) -> list[SectionSpec]:
        codec = get_codec(self.codec)
        return codec.sections("k", self.shape, self.dtype) + codec.sections(
            "v", self.shape, self.dtype
        )


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _header_len(n_sections: int) -> int:
    return _align(_FIXED.size + n_sections * _SECTION.size)


def _offsets(layout: ChunkLayout) -> tuple[list[SectionSpec], list[int], int]:
    specs = layout.sections()
    pos = _header_len(len(specs))
    offsets = []
    for spec in specs:
        offsets.append(pos)
        pos = _align(pos + spec.nbytes)
    return specs, offsets, pos


def packed_size(layout: ChunkLayout) -> int:
    """Bytes of the payload of a chunk with this layout (header included)."""
    return _offsets(layout)[2]


def _byte_view(buf: Any) -> torch.Tensor:
    """A uint8 tensor over ``buf`` without copying (bytes are read-only: never written)."""
    if isinstance(buf, torch.Tensor):
        return buf.view(torch.uint8).reshape(-1)
    view = memoryview(buf).cast("B")
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # frombuffer warns on read-only buffers; we only read them
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)


def _section_tensor(raw: torch.Tensor, spec: SectionSpec, offset: int) -> torch.Tensor:
    return raw[offset : offset + spec.nbytes].view(spec.dtype).view(spec.shape)


def _encode_header(layout: ChunkLayout, specs: list[SectionSpec], offsets: list[int]) -> bytes:
    codec = get_codec(layout.codec)
    head = [
        _FIXED.pack(
            MAGIC,
            LAYOUT_VERSION,
            _header_len(len(specs)),
            codec.code,
            DTYPE_IDS[layout.dtype],
            layout.layers,
            layout.kv_heads,
            layout.head_dim,
            layout.tokens,
            len(specs),
            0,
        )
    ]
    for spec, off in zip(specs, offsets, strict=True):
        dims = (*spec.shape, *([0] * (4 - len(spec.shape))))
        which = 0 if spec.which == "k" else 1
        role = _ROLES.index(spec.role)
        head.append(
            _SECTION.pack(
                which, role, DTYPE_IDS[spec.dtype], len(spec.shape), *dims, off, spec.nbytes
            )
        )
    return b"".join(head)


def _stack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack([t.squeeze(0) if t.dim() == 4 else t for t in tensors])


def pack_into(
    buf: Any,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    codec: str | Codec = "raw",
) -> ChunkLayout:
    """Encode ``keys[l]``/``values[l]`` (``[H, T, D]`` or ``[1, H, T, D]``, one per layer) into
    ``buf`` (writable, at least :func:`packed_size` bytes); returns the layout written."""
    k, v = _stack(keys), _stack(values)
    if k.shape != v.shape or k.dtype != v.dtype:
        raise LayoutError(f"keys {tuple(k.shape)} and values {tuple(v.shape)} differ")
    c = get_codec(codec)
    layers, heads, tokens, dim = k.shape
    layout = ChunkLayout(layers, heads, dim, tokens, k.dtype, c.name)
    specs, offsets, total = _offsets(layout)
    raw = _byte_view(buf)
    if raw.numel() < total:
        raise LayoutError(f"buffer of {raw.numel()} bytes is smaller than the payload ({total})")
    header = _encode_header(layout, specs, offsets)
    raw[: len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
    parts = c.encode(k, "k") + c.encode(v, "v")
    for spec, off, part in zip(specs, offsets, parts, strict=True):
        _section_tensor(raw, spec, off).copy_(part)
    return layout


def pack_chunk(
    keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], codec: str | Codec = "raw"
) -> bytearray:
    """Encode one chunk into a new payload (see :func:`pack_into`)."""
    k0 = keys[0] if keys[0].dim() == 3 else keys[0].squeeze(0)
    heads, tokens, dim = k0.shape
    layout = ChunkLayout(len(keys), heads, dim, tokens, k0.dtype, get_codec(codec).name)
    buf = bytearray(packed_size(layout))
    pack_into(buf, keys, values, codec)
    return buf


def _parse_sections(raw: torch.Tensor, count: int) -> tuple[list[SectionSpec], list[int]]:
    specs, offsets = [], []
    data = bytes(raw[_FIXED.size : _FIXED.size + count * _SECTION.size].cpu().numpy())
    for i in range(count):
        which, role, dt, ndim, *rest = _SECTION.unpack_from(data, i * _SECTION.size)
        dims, off, nbytes = rest[:4], rest[4], rest[5]
        if which > 1 or role >= len(_ROLES) or dt not in DTYPES_BY_ID or ndim > 4:
            raise LayoutError(f"section {i} is malformed")
        spec = SectionSpec("k" if which == 0 else "v", _ROLES[role], DTYPES_BY_ID[dt],
                           tuple(dims[:ndim]))  # fmt: skip
        if spec.nbytes != nbytes or off + nbytes > raw.numel():
            raise LayoutError(f"section {i} does not fit the payload")
        specs.append(spec)
        offsets.append(off)
    return specs, offsets


def read_layout(payload: Any) -> tuple[ChunkLayout, list[SectionSpec], list[int]]:
    """Parse and check a payload's header: its layout, sections and their offsets."""
    raw = _byte_view(payload)
    if raw.numel() < _FIXED.size:
        raise LayoutError("payload shorter than the layout header")
    fixed = _FIXED.unpack(bytes(raw[: _FIXED.size].cpu().numpy()))  # header of a cuda lease too
    magic, version, hlen, codec_id, dtype_id, layers, heads, dim, tokens, count, _ = fixed
    if magic != MAGIC:
        raise LayoutError("not a kvstrata chunk payload (bad magic)")
    if version != LAYOUT_VERSION:
        raise LayoutError(f"layout version {version} is not supported (this is {LAYOUT_VERSION})")
    if codec_id not in CODECS_BY_CODE or dtype_id not in DTYPES_BY_ID:
        raise LayoutError(f"unknown codec {codec_id} or dtype {dtype_id}")
    if hlen != _header_len(count) or hlen > raw.numel():
        raise LayoutError("header length does not match its section count")
    layout = ChunkLayout(
        layers, heads, dim, tokens, DTYPES_BY_ID[dtype_id], CODECS_BY_CODE[codec_id].name
    )
    specs, offsets = _parse_sections(raw, count)
    if specs != layout.sections():
        raise LayoutError(f"sections do not match codec {layout.codec}")
    return layout, specs, offsets


def unpack_into(
    payload: Any,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    expect: ChunkLayout | None = None,
) -> ChunkLayout:
    """Decode a payload into ``keys[l]``/``values[l]`` (``[H, T, D]`` views, e.g. slices of a
    preallocated cache). ``expect`` (when given) must equal the payload's layout. A payload a
    client coded with :func:`kvstrata.codecs.encode` (``KVSX``) is decoded first."""
    if not isinstance(payload, torch.Tensor) and codecs.is_container(payload):
        try:
            payload = codecs.decode(payload)
        except codecs.CodecError as exc:
            raise LayoutError(f"coded payload: {exc}") from None
    layout, specs, offsets = read_layout(payload)
    if expect is not None and layout != expect:
        raise LayoutError(f"payload layout {layout} is not the expected {expect}")
    if len(keys) != layout.layers or len(values) != layout.layers:
        raise LayoutError(f"payload has {layout.layers} layers, got {len(keys)} outputs")
    want = (layout.kv_heads, layout.tokens, layout.head_dim)
    for t in (*keys, *values):
        if tuple(t.shape[-3:]) != want:
            raise LayoutError(f"output of shape {tuple(t.shape)} does not hold {want}")
    raw = _byte_view(payload)
    codec = get_codec(layout.codec)
    tensors = [_section_tensor(raw, s, off) for s, off in zip(specs, offsets, strict=True)]
    kparts = [t for t, s in zip(tensors, specs, strict=True) if s.which == "k"]
    vparts = [t for t, s in zip(tensors, specs, strict=True) if s.which == "v"]
    for layer in range(layout.layers):
        out_k = keys[layer][0] if keys[layer].dim() == 4 else keys[layer]
        out_v = values[layer][0] if values[layer].dim() == 4 else values[layer]
        codec.decode_layer([p[layer] for p in kparts], "k", out_k)
        codec.decode_layer([p[layer] for p in vparts], "v", out_v)
    return layout
