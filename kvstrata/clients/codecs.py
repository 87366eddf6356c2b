"""KV codecs: how one chunk's keys and values are turned into bytes and back.

A codec sees the keys (or the values) of every layer of one chunk as one tensor
``[layers, kv_heads, tokens, head_dim]`` and turns it into a few *sections* (plain tensors:
quantized data, scales, zero points). :mod:`kvstrata.clients.layout` lays the sections out
behind a self-describing header; decoding works layer by layer, straight into the caller's
(usually strided) cache tensors.

Codecs:

``raw``  lossless: the model's own dtype, byte for byte.
``fp8``  float8 e4m3 with a symmetric scale: keys per channel, values per token.
``int8`` / ``int4``  asymmetric integer quantization in the KIVI manner (Liu et al., 2024):
         keys per channel (statistics over the chunk's tokens, since key outliers sit in fixed
         channels), values per token (statistics over the channels). int4 packs two values a byte.

Statistics of keys are float32 (one set per channel and chunk, so their cost is amortized over
the chunk's tokens, and a zero point far from 0 keeps its precision); statistics of values are
float16 (one set per token and head, 2 to 4 bytes against ``head_dim`` data bytes).

The codec's name is part of the namespace (:func:`kvstrata.clients.hf.model_namespace`), so
chunks written with different codecs never mix.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "CODECS",
    "DTYPE_IDS",
    "Codec",
    "CodecReport",
    "SectionSpec",
    "get_codec",
    "measure",
]

Which = Literal["k", "v"]

#: dtypes that may appear in a payload, by their id in the header (never renumber).
DTYPE_IDS: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.uint8: 4,
    torch.float8_e4m3fn: 5,
}
DTYPES_BY_ID = {v: k for k, v in DTYPE_IDS.items()}

_FP8_MAX = 448.0  # largest finite float8 e4m3fn
_TINY = 1e-8  # smallest scale: keeps an all-equal channel or token from dividing by zero


@dataclass(frozen=True, slots=True)
class SectionSpec:
    """One tensor of an encoded chunk: for keys or values, its role, dtype and full shape."""

    which: Which
    role: str  # "data", "scale" or "zero"
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for dim in self.shape:
            n *= dim
        return n


class Codec(ABC):
    """Encodes ``[layers, heads, tokens, head_dim]`` keys or values into sections and back."""

    name: str
    code: int  # id in the payload header (never renumber)
    lossless: bool = False

    @abstractmethod
    def sections(
        self, which: Which, shape: tuple[int, int, int, int], dtype: torch.dtype
    ) -> list[SectionSpec]:
        """The sections :meth:`encode` produces for a tensor of this shape and dtype."""

    @abstractmethod
    def encode(self, x: torch.Tensor, which: Which) -> list[torch.Tensor]:
        """Sections (contiguous, in :meth:`sections` order) of ``x`` ``[L, H, T, D]``."""

    @abstractmethod
    def decode_layer(self, parts: Sequence[torch.Tensor], which: Which, out: torch.Tensor) -> None:
        """Write one layer (``parts`` are the sections indexed at that layer) into ``out``
        ``[H, T, D]``, which may be a strided view of a larger cache tensor."""


class RawCodec(Codec):
    name = "raw"
    code = 0
    lossless = True

    def sections(
        self, which: Which, shape: tuple[int, int, int, int], dtype: torch.dtype
    ) -> list[SectionSpec]:
        return [SectionSpec(which, "data", dtype, shape)]

    def encode(self, x: torch.Tensor, which: Which) -> list[torch.Tensor]:
        return [x.contiguous()]

    def decode_layer(self, parts: Sequence[torch.Tensor], which: Which, out: torch.Tensor) -> None:
        out.copy_(parts[0])


def _stat_shape(which: Which, shape: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    layers, heads, tokens, dim = shape
    return (layers, heads, 1, dim) if which == "k" else (layers, heads, tokens, 1)


def _stat_dtype(which: Which) -> torch.dtype:
    return torch.float32 if which == "k" else torch.float16


def _reduce_dim(which: Which) -> int:
    return 2 if which == "k" else 3  # keys: over tokens (per channel); values: over channels


class Fp8Codec(Codec):
    name = "fp8"
    code = 1

    def sections(
        self, which: Which, shape: tuple[int, int, int, int], dtype: torch.dtype
    ) -> list[SectionSpec]:
        return [
            SectionSpec(which, "data", torch.float8_e4m3fn, shape),
            SectionSpec(which, "scale", _stat_dtype(which), _stat_shape(which, shape)),
        ]

    def encode(self, x: torch.Tensor, which: Which) -> list[torch.Tensor]:
        x32 = x.float()
        amax = x32.abs().amax(dim=_reduce_dim(which), keepdim=True)
        scale = (amax / _FP8_MAX).clamp_min(_TINY).to(_stat_dtype(which))
        q = (x32 / scale.float()).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
        return [q.contiguous(), scale.contiguous()]

    def decode_layer(self, parts: Sequence[torch.Tensor], which: Which, out: torch.Tensor) -> None:
        data, scale = parts
        out.copy_(data.float() * scale.float())


class IntCodec(Codec):
    """Asymmetric ``bits``-bit quantization, KIVI axes; int4 packs two values into a byte."""

    def __init__(self, bits: int) -> None:
        if bits not in (4, 8):
            raise ValueError("bits must be 4 or 8")
        self.bits = bits
        self.name = f"int{bits}"
        self.code = 2 if bits == 8 else 3
        self.qmax = (1 << bits) - 1

    def _data_shape(self, shape: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
        layers, heads, tokens, dim = shape
        if self.bits == 4:
            if dim % 2:
                raise ValueError(f"int4 needs an even head_dim, got {dim}")
            return (layers, heads, tokens, dim // 2)
        return shape

    def sections(
        self, which: Which, shape: tuple[int, int, int, int], dtype: torch.dtype
    ) -> list[SectionSpec]:
        stat = _stat_shape(which, shape)
        return [
            SectionSpec(which, "data", torch.uint8, self._data_shape(shape)),
            SectionSpec(which, "scale", _stat_dtype(which), stat),
            SectionSpec(which, "zero", _stat_dtype(which), stat),
        ]

    def encode(self, x: torch.Tensor, which: Which) -> list[torch.Tensor]:
        x32 = x.float()
        dim = _reduce_dim(which)
        lo = x32.amin(dim=dim, keepdim=True).to(_stat_dtype(which))
        hi = x32.amax(dim=dim, keepdim=True)
        # Scale from the stored (rounded) zero point so the range still covers ``hi``.
        scale = ((hi - lo.float()) / self.qmax).clamp_min(_TINY).to(_stat_dtype(which))
        q = ((x32 - lo.float()) / scale.float()).round_().clamp_(0, self.qmax).to(torch.uint8)
        if self.bits == 4:
            q = q[..., 0::2] | (q[..., 1::2] << 4)
        return [q.contiguous(), scale.contiguous(), lo.contiguous()]

    def decode_layer(self, parts: Sequence[torch.Tensor], which: Which, out: torch.Tensor) -> None:
        data, scale, zero = parts
        if self.bits == 4:
            data = torch.stack((data & 0x0F, data >> 4), dim=-1).flatten(-2)
        out.copy_(data.float() * scale.float() + zero.float())


CODECS: dict[str, Codec] = {c.name: c for c in (RawCodec(), Fp8Codec(), IntCodec(8), IntCodec(4))}
CODECS_BY_CODE: dict[int, Codec] = {c.code: c for c in CODECS.values()}


def get_codec(codec: str | Codec) -> Codec:
    """The codec of that name (``raw``, ``fp8``, ``int8``, ``int4``), or the codec itself."""
    if isinstance(codec, Codec):
        return codec
    try:
        return CODECS[codec]
    except KeyError:
        raise ValueError(f"unknown codec {codec!r}; known: {', '.join(CODECS)}") from None


@dataclass(frozen=True, slots=True)
class CodecReport:
    """Size and reconstruction error of one codec on one chunk of keys and values."""

    codec: str
    tokens: int
    payload_bytes: int  # sections only, without the layout header
    raw_bytes: int  # the same KV in the model's dtype
    key_rel_rmse: float  # ||k - k'|| / ||k||
    value_rel_rmse: float
    max_abs_error: float

    @property
    def bytes_per_token(self) -> float:
        return self.payload_bytes / self.tokens

    @property
    def ratio(self) -> float:
        """Compression ratio against the model's dtype (raw = 1)."""
        return self.raw_bytes / self.payload_bytes


def _roundtrip(codec: Codec, x: torch.Tensor, which: Which) -> tuple[torch.Tensor, int]:
    parts = codec.encode(x, which)
    out = torch.empty(x.shape, dtype=torch.float32)
    for layer in range(x.shape[0]):
        codec.decode_layer([p[layer] for p in parts], which, out[layer])
    return out, sum(p.numel() * p.element_size() for p in parts)


def _rel_rmse(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).norm() / x.norm().clamp_min(_TINY))


def measure(codec: str | Codec, keys: torch.Tensor, values: torch.Tensor) -> CodecReport:
    """Encode and decode ``keys``/``values`` ``[L, H, T, D]``; report size and error."""
    c = get_codec(codec)
    k2, kbytes = _roundtrip(c, keys, "k")
    v2, vbytes = _roundtrip(c, values, "v")
    k32, v32 = keys.float(), values.float()
    return CodecReport(
        codec=c.name,
        tokens=keys.shape[2],
        payload_bytes=kbytes + vbytes,
        raw_bytes=keys.numel() * keys.element_size() + values.numel() * values.element_size(),
        key_rel_rmse=_rel_rmse(k32, k2),
        value_rel_rmse=_rel_rmse(v32, v2),
        max_abs_error=float(max((k32 - k2).abs().max(), (v32 - v2).abs().max())),
    )
