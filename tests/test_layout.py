"""Chunk tensor layout: self-describing header, pack/unpack into preallocated cache slices."""

from __future__ import annotations

import ctypes
import struct
from multiprocessing import shared_memory

import pytest

pytest.importorskip("torch")

import torch

from kvstrata.clients.layout import (
    ALIGN,
    LAYOUT_VERSION,
    ChunkLayout,
    LayoutError,
    _byte_view,
    pack_chunk,
    pack_into,
    packed_size,
    read_layout,
    unpack_into,
)

LAYERS, HEADS, TOKENS, DIM = 3, 2, 8, 16


def _chunk(dtype: torch.dtype = torch.float32) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    keys = [torch.randn(1, HEADS, TOKENS, DIM, generator=g).to(dtype) for _ in range(LAYERS)]
    values = [torch.randn(1, HEADS, TOKENS, DIM, generator=g).to(dtype) for _ in range(LAYERS)]
    return keys, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_raw_roundtrip_into_slices_of_a_preallocated_cache(dtype: torch.dtype) -> None:
    keys, values = _chunk(dtype)
    payload = pack_chunk(keys, values, "raw")
    # a cache holding 3 chunks; this payload is the middle one
    big_k = [torch.full((1, HEADS, 3 * TOKENS, DIM), -7.0, dtype=dtype) for _ in range(LAYERS)]
    big_v = [torch.full((1, HEADS, 3 * TOKENS, DIM), -7.0, dtype=dtype) for _ in range(LAYERS)]
    sl = slice(TOKENS, 2 * TOKENS)
    layout = unpack_into(bytes(payload), [k[:, :, sl] for k in big_k], [v[:, :, sl] for v in big_v])
    assert layout == ChunkLayout(LAYERS, HEADS, DIM, TOKENS, dtype, "raw")
    for layer in range(LAYERS):
        assert torch.equal(big_k[layer][:, :, sl], keys[layer])
        assert torch.equal(big_v[layer][:, :, sl], values[layer])
        assert bool((big_k[layer][:, :, :TOKENS] == -7).all())  # neighbours untouched
        assert bool((big_v[layer][:, :, 2 * TOKENS :] == -7).all())


def test_header_is_self_describing_and_sections_aligned() -> None:
    keys, values = _chunk(torch.bfloat16)
    payload = pack_chunk(keys, values, "int4")
    layout, specs, offsets = read_layout(payload)
    assert layout == ChunkLayout(LAYERS, HEADS, DIM, TOKENS, torch.bfloat16, "int4")
    assert len(payload) == packed_size(layout)
    assert payload[:4] == b"KVST" and struct.unpack_from("<H", payload, 4)[0] == LAYOUT_VERSION
    assert [(s.which, s.role) for s in specs] == [
        ("k", "data"), ("k", "scale"), ("k", "zero"),
        ("v", "data"), ("v", "scale"), ("v", "zero"),
    ]  # fmt: skip
    assert all(off % ALIGN == 0 for off in offsets)
    assert specs[0].shape == (LAYERS, HEADS, TOKENS, DIM // 2)


@pytest.mark.parametrize("codec", ["fp8", "int8", "int4"])
def test_lossy_codecs_roundtrip_close(codec: str) -> None:
    keys, values = _chunk()
    payload = pack_chunk(keys, values, codec)
    out_k = [torch.empty(HEADS, TOKENS, DIM) for _ in range(LAYERS)]
    out_v = [torch.empty(HEADS, TOKENS, DIM) for _ in range(LAYERS)]
    unpack_into(payload, out_k, out_v)
    tol = {"fp8": 0.3, "int8": 0.05, "int4": 0.6}[codec]  # |x| < ~4.5 for N(0,1) samples
    for a, b in zip(out_k + out_v, keys + values, strict=True):
        assert (a - b[0]).abs().max() < tol
    assert len(payload) < packed_size(ChunkLayout(LAYERS, HEADS, DIM, TOKENS, torch.float32))


def test_pack_into_and_unpack_from_shared_memory_without_copies() -> None:
    """The lease path: the payload lives in a shared-memory region; reading views it in place."""
    keys, values = _chunk()
    layout = ChunkLayout(LAYERS, HEADS, DIM, TOKENS, torch.float32, "raw")
    shm = shared_memory.SharedMemory(create=True, size=packed_size(layout) + 4096)
    try:
        assert shm.buf is not None
        region = shm.buf[4096:]  # a chunk at an offset inside the region
        assert pack_into(region, keys, values) == layout
        view = _byte_view(region)
        assert view.data_ptr() == ctypes.addressof(ctypes.c_char.from_buffer(region))
        out_k = [torch.empty(1, HEADS, TOKENS, DIM) for _ in range(LAYERS)]
        out_v = [torch.empty(1, HEADS, TOKENS, DIM) for _ in range(LAYERS)]
        unpack_into(region, out_k, out_v, expect=layout)
        assert all(torch.equal(a, b) for a, b in zip(out_k, keys, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(out_v, values, strict=True))
        del view, region
    finally:
        shm.close()
        shm.unlink()


def test_rejects_malformed_and_unexpected_payloads() -> None:
    keys, values = _chunk()
    payload = pack_chunk(keys, values)
    out_k = [torch.empty(HEADS, TOKENS, DIM) for _ in range(LAYERS)]
    out_v = [torch.empty(HEADS, TOKENS, DIM) for _ in range(LAYERS)]
    with pytest.raises(LayoutError, match="magic"):
        unpack_into(b"XXXX" + bytes(payload[4:]), out_k, out_v)
    with pytest.raises(LayoutError, match="fit"):
        unpack_into(bytes(payload[: len(payload) - 64]), out_k, out_v)
    bad_version = bytearray(payload)
    struct.pack_into("<H", bad_version, 4, 99)
    with pytest.raises(LayoutError, match="version"):
        unpack_into(bad_version, out_k, out_v)
    other = ChunkLayout(LAYERS, HEADS, DIM, TOKENS, torch.float32, "int8")
    with pytest.raises(LayoutError, match="expected"):
        unpack_into(payload, out_k, out_v, expect=other)
    with pytest.raises(LayoutError, match="does not hold"):
        unpack_into(payload, [torch.empty(HEADS, TOKENS + 1, DIM)] * LAYERS, out_v)
    with pytest.raises(LayoutError, match="smaller"):
        pack_into(bytearray(100), keys, values)
