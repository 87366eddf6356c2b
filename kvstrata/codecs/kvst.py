"""Where the tensors of a ``KVST`` payload (:mod:`kvstrata.clients.layout`) lie, read with
``struct`` only (the server has no torch): enough for a codec to code each layer's keys and
values on their own. Anything that is not a well-formed version-1 payload is ``None``: the
codecs then treat the bytes as opaque.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

_FIXED = struct.Struct("<4sHHBBHHHIHH")  # the layout's fixed header (layout.py)
_SECTION = struct.Struct("<BBBB4IQQ")
_ELEMENT = {1: 4, 2: 2, 3: 2, 4: 1, 5: 1}  # layout's DTYPE_IDS → bytes per element
DTYPE_FP32, DTYPE_FP16, DTYPE_BF16, DTYPE_U8 = 1, 2, 3, 4
CODEC_RAW, CODEC_INT4 = 0, 3


@dataclass(frozen=True, slots=True)
class Section:
    which: int  # 0 keys, 1 values
    role: int  # 0 data, 1 scale, 2 zero
    dtype: int
    layers: int  # first dimension of the shape
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Kvst:
    codec: int
    dtype: int
    sections: tuple[Section, ...]


def read(payload: memoryview) -> Kvst | None:
    """The payload's sections, or None when it is not a version-1 ``KVST`` payload."""
    if payload.nbytes < _FIXED.size:
        return None
    magic, version, hlen, codec, dtype, layers, *_, count, _ = _FIXED.unpack_from(payload)
    if magic != b"KVST" or version != 1 or hlen > payload.nbytes:
        return None
    if _FIXED.size + count * _SECTION.size > hlen:
        return None
    sections, end = [], hlen
    for i in range(count):
        at = _FIXED.size + i * _SECTION.size
        which, role, dt, ndim, *rest = _SECTION.unpack_from(payload, at)
        dims, offset, nbytes = rest[:4], rest[4], rest[5]
        if dt not in _ELEMENT or not 1 <= ndim <= 4 or dims[0] != layers or layers == 0:
            return None
        n = _ELEMENT[dt]
        for d in dims[:ndim]:
            n *= d
        if n != nbytes or offset < end or offset + nbytes > payload.nbytes or nbytes % layers:
            return None  # sections are in order, after the header, inside the payload
        end = offset + nbytes
        sections.append(Section(which, role, dt, layers, offset, nbytes))
    return Kvst(codec, dtype, tuple(sections))
