"""The byte format of one llama.cpp sequence's KV state, cut into per-token-range chunks.

Pinned to the llama.cpp that **llama-cpp-python 0.3.36** vendors: ``llama_state_seq_get_data``
(``src/llama-context.cpp``) writes ``u32 0xaf143cd8, i32 seq_id`` and then
``llama_kv_cache::state_write`` (``src/llama-kv-cache.cpp``)::

    u32 n_stream
    per stream: u32 cell_count; if cell_count > 0:
      per cell (cell order):  i32 pos, u32 n_seq_id (=1), i32 seq_id          (12 B)
      u32 v_trans, u32 n_layer
      per layer: i32 k_type, u64 k_row, cell_count × k_row bytes
      v_trans == 0: per layer: i32 v_type, u64 v_row, cell_count × v_row bytes
      v_trans == 1: per layer: i32 v_type, u32 v_el, u32 n_embd_v,
                    n_embd_v rows of cell_count × v_el bytes (V transposed)

``llama_state_get_data`` (the whole context, what ``Llama.save_state`` keeps) writes the model
architecture as ``u32 length, bytes`` and then the same ``state_write`` with ``seq_id = -1``.

This module parses either form (every field checked, nothing past the end, nothing left over),
cuts the cells of positions ``[start, stop)`` into a self-describing chunk payload, and
assembles a prefix of chunks back into a state ``llama_state_seq_set_data`` (or
``llama_state_set_data``) accepts. It refuses what it cannot cut rather than guess: several
streams, cells shared by several sequences, per-cell extras (M-RoPE, per-layer embeddings: the
fields do not line up and the length check fails), positions with gaps or repeats. No llama.cpp
import here: the codec is tested on its own against a writer that mirrors ``state_write``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "CHUNK_MAGIC",
    "SEQ_MAGIC",
    "KVLayout",
    "LayerLayout",
    "SeqState",
    "StateError",
    "assemble",
    "encode_chunk",
    "ggml_row_size",
    "parse_chunk",
    "parse_state",
]

SEQ_MAGIC = 0xAF143CD8  # llama-context.cpp io_magic
CHUNK_MAGIC = b"KVLC"
CHUNK_VERSION = 1
_CELL = np.dtype([("pos", "<i4"), ("n_seq", "<u4"), ("seq", "<i4")])  # 12 B per cell
_LAYER = struct.Struct("<iIiIII")  # k_type k_row v_type v_row v_el v_embd, 24 B
_CHUNK_HEAD = struct.Struct("<4sHHII")  # magic version flags n_tokens n_layer

# ggml types llama.cpp allows for the KV cache: (bytes per block, elements per block)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("f32", 4, 1),
    1: ("f16", 2, 1),
    2: ("q4_0", 18, 32),
    3: ("q4_1", 20, 32),
    6: ("q5_0", 22, 32),
    7: ("q5_1", 24, 32),
    8: ("q8_0", 34, 32),
    20: ("iq4_nl", 18, 32),
    30: ("bf16", 2, 1),
}


class StateError(ValueError):
    """A state or chunk that this codec cannot cut or that does not match the running model."""


def ggml_row_size(ggml_type: int, n: int) -> int:
    """``ggml_row_size`` for the KV cache types (a row of ``n`` elements)."""
    if ggml_type not in GGML_TYPES:
        raise StateError(f"KV cache type {ggml_type} is not one this codec knows")
    _, size, block = GGML_TYPES[ggml_type]
    if n % block:
        raise StateError(f"a row of {n} elements is not whole blocks of type {ggml_type}")
    return n // block * size


@dataclass(frozen=True, slots=True)
class LayerLayout:
    """One layer's K and V as llama.cpp writes them. ``v_el``/``v_embd`` are set (and
    ``v_row == v_el * v_embd``) only when V is transposed."""

    k_type: int
    k_row: int
    v_type: int
    v_row: int
    v_el: int = 0
    v_embd: int = 0


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The KV cache layout of one context: V transposed (flash attention off) or not, layers."""

    v_trans: bool
    layers: tuple[LayerLayout, ...]

    @classmethod
    def expected(
        cls, n_layer: int, n_embd_k: int, n_embd_v: int, k_type: int, v_type: int, v_trans: bool
    ) -> KVLayout:
        """What llama.cpp writes for uniform layers of these sizes and cache types."""
        el = ggml_row_size(v_type, 1) if v_trans else 0
        layer = LayerLayout(
            k_type,
            ggml_row_size(k_type, n_embd_k),
            v_type,
            ggml_row_size(v_type, n_embd_v),
            el,
            n_embd_v if v_trans else 0,
        )
        return cls(v_trans, (layer,) * n_layer)

    @property
    def cell_bytes(self) -> int:
        """KV bytes per token, all layers."""
        return sum(la.k_row + la.v_row for la in self.layers)

    def tag(self) -> str:
        """A short name for namespaces: ``vt1.L2.k1v1`` (types per layer when they differ)."""
        types = sorted({f"k{la.k_type}v{la.v_type}" for la in self.layers})
        return f"vt{int(self.v_trans)}.L{len(self.layers)}.{'+'.join(types)}"


@dataclass(frozen=True, slots=True)
class SeqState:
    """One parsed state: the header it came with and views of its cells, in cell order.
    ``k[i]`` is ``(cells, k_row)`` bytes; ``v[i]`` is ``(cells, v_row)``, or
    ``(v_embd, cells, v_el)`` when V is transposed."""

    layout: KVLayout
    positions: np.ndarray
    k: tuple[np.ndarray, ...]
    v: tuple[np.ndarray, ...]
    seq_id: int | None = None  # the sequence form
    arch: str | None = None  # the whole-context form

    @property
    def n_cells(self) -> int:
        return len(self.positions)

    def order(self, n_tokens: int) -> np.ndarray | slice:
        """Indices of the cells of positions ``0 … n_tokens-1``, in position order (a slice
        when they are stored in order). Refuses gaps and repeats."""
        pos = self.positions
        if n_tokens > len(pos):
            raise StateError(f"state holds {len(pos)} cells, {n_tokens} tokens asked")
        if np.array_equal(pos[:n_tokens], np.arange(n_tokens, dtype=pos.dtype)):
            return slice(0, n_tokens)
        idx = np.flatnonzero((pos >= 0) & (pos < n_tokens))
        sorted_idx = idx[np.argsort(pos[idx], kind="stable")]
        if not np.array_equal(pos[sorted_idx], np.arange(n_tokens, dtype=pos.dtype)):
            raise StateError(f"state cells do not hold positions 0..{n_tokens - 1} once each")
        return sorted_idx


class _Reader:
    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.at = 0

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.at + n > len(self.buf):
            raise StateError(f"state truncated in {what} (offset {self.at}, {n} bytes needed)")
        view = self.buf[self.at : self.at + n]
        self.at += n
        return view

    def unpack(self, fmt: str, what: str) -> tuple[int, ...]:
        s = struct.Struct(fmt)
        return s.unpack(self.take(s.size, what))

    def rows(self, shape: tuple[int, ...], what: str) -> np.ndarray:
        n = int(np.prod(shape))
        return np.frombuffer(self.take(n, what), dtype=np.uint8).reshape(shape)


def parse_state(
    data: bytes | bytearray | memoryview, expect: KVLayout | None = None, context: bool = False
) -> SeqState:
    """Parse ``llama_state_seq_get_data`` output (or, with ``context``, the whole-context
    ``llama_state_get_data``), checking every field (against ``expect`` when given)."""
    r = _Reader(memoryview(data).cast("B"))
    seq_id: int | None = None
    arch: str | None = None
    if context:
        (n,) = r.unpack("<I", "architecture length")
        if n > 256:
            raise StateError(f"architecture name of {n} bytes: not a llama.cpp context state")
        arch = bytes(r.take(n, "architecture")).decode("ascii", "replace")
    else:
        magic, seq_id = r.unpack("<Ii", "header")
        if magic != SEQ_MAGIC:
            raise StateError(f"not a llama.cpp sequence state (magic {magic:#010x})")
    (n_stream,) = r.unpack("<I", "stream count")
    if n_stream != 1:
        raise StateError(f"{n_stream} KV streams: only a unified single-stream cache is supported")
    (cells,) = r.unpack("<I", "cell count")
    if cells == 0:
        raise StateError("the sequence holds no cells")
    meta = np.frombuffer(r.take(cells * _CELL.itemsize, "cell metadata"), dtype=_CELL)
    if not np.all(meta["n_seq"] == 1):
        raise StateError("cells shared by several sequences (or per-cell extras): cannot cut")
    want_seq = 0 if seq_id is None else seq_id
    if not np.all(meta["seq"] == want_seq):
        raise StateError(f"cells of another sequence than {want_seq} (or per-cell extras)")
    layout, k, v = _parse_data(r, cells)
    if r.at != len(r.buf):
        raise StateError(f"{len(r.buf) - r.at} bytes left over after the KV data")
    if expect is not None and layout != expect:
        raise StateError(f"KV layout {layout} is not the model's {expect}")
    return SeqState(layout, meta["pos"].copy(), k, v, seq_id, arch)


def _parse_data(
    r: _Reader, cells: int
) -> tuple[KVLayout, tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    v_trans, n_layer = r.unpack("<II", "layout")
    if v_trans not in (0, 1) or not 0 < n_layer <= 4096:
        raise StateError(f"v_trans={v_trans} n_layer={n_layer}: not a KV cache this codec reads")
    k_parts: list[tuple[int, int, np.ndarray]] = []
    for il in range(n_layer):
        k_type, k_row = r.unpack("<iQ", f"K header of layer {il}")
        _check_row(k_type, k_row, f"K of layer {il}")
        k_parts.append((k_type, k_row, r.rows((cells, k_row), f"K of layer {il}")))
    layers: list[LayerLayout] = []
    vs: list[np.ndarray] = []
    for il, (k_type, k_row, _) in enumerate(k_parts):
        if not v_trans:
            v_type, v_row = r.unpack("<iQ", f"V header of layer {il}")
            _check_row(v_type, v_row, f"V of layer {il}")
            vs.append(r.rows((cells, v_row), f"V of layer {il}"))
            layers.append(LayerLayout(k_type, k_row, v_type, v_row))
        else:
            v_type, v_el, v_embd = r.unpack("<iII", f"V header of layer {il}")
            if v_type not in GGML_TYPES or GGML_TYPES[v_type][2] != 1:
                raise StateError(f"transposed V of layer {il} has block type {v_type}")
            if v_el != ggml_row_size(v_type, 1) or v_embd == 0:
                raise StateError(f"transposed V of layer {il}: element size {v_el}, {v_embd} rows")
            vs.append(r.rows((v_embd, cells, v_el), f"V of layer {il}"))
            layers.append(LayerLayout(k_type, k_row, v_type, v_el * v_embd, v_el, v_embd))
    layout = KVLayout(bool(v_trans), tuple(layers))
    return layout, tuple(p[2] for p in k_parts), tuple(vs)


def _check_row(ggml_type: int, row: int, what: str) -> None:
    if ggml_type not in GGML_TYPES:
        raise StateError(f"{what}: KV cache type {ggml_type} is not one this codec knows")
    _, size, _ = GGML_TYPES[ggml_type]
    if row == 0 or row % size or row > 1 << 24:
        raise StateError(f"{what}: row of {row} bytes is not whole blocks of type {ggml_type}")


def _head(layout: KVLayout, n_tokens: int) -> bytes:
    parts = [
        _CHUNK_HEAD.pack(
            CHUNK_MAGIC, CHUNK_VERSION, int(layout.v_trans), n_tokens, len(layout.layers)
        )
    ]
    parts += [
        _LAYER.pack(la.k_type, la.k_row, la.v_type, la.v_row, la.v_el, la.v_embd)
        for la in layout.layers
    ]
    return b"".join(parts)


def chunk_size(layout: KVLayout, n_tokens: int) -> int:
    return _CHUNK_HEAD.size + _LAYER.size * len(layout.layers) + n_tokens * layout.cell_bytes


def encode_chunk(state: SeqState, start: int, stop: int) -> bytearray:
    """The chunk payload of positions ``[start, stop)``: a header naming the layout, then every
    layer's K rows, then every layer's V (rows, or ``v_embd`` rows of ``stop-start`` elements
    when transposed)."""
    order = state.order(stop)
    if not 0 <= start < stop:
        raise StateError(f"empty or negative token range [{start}, {stop})")
    sel = slice(start, stop) if isinstance(order, slice) else order[start:stop]
    n = stop - start
    out = bytearray(chunk_size(state.layout, n))
    head = _head(state.layout, n)
    out[: len(head)] = head
    at = len(head)
    parts = [k[sel] for k in state.k]
    parts += [v[:, sel, :] if state.layout.v_trans else v[sel] for v in state.v]
    for part in parts:
        dst = np.frombuffer(memoryview(out)[at : at + part.nbytes], dtype=np.uint8)
        dst.reshape(part.shape)[...] = part
        at += part.nbytes
    return out


@dataclass(frozen=True, slots=True)
class Chunk:
    n_tokens: int
    k: tuple[np.ndarray, ...]
    v: tuple[np.ndarray, ...]


def parse_chunk(payload: bytes | bytearray | memoryview, expect: KVLayout) -> Chunk:
    """A chunk payload's views, refused unless its header names ``expect`` and its length is
    exactly what the header says."""
    r = _Reader(memoryview(payload).cast("B"))
    magic, version, flags, n, n_layer = r.unpack(_CHUNK_HEAD.format, "chunk header")
    if magic != CHUNK_MAGIC or version != CHUNK_VERSION:
        raise StateError(f"not a kvstrata llama.cpp chunk (magic {magic!r}, version {version})")
    layers = tuple(
        LayerLayout(*r.unpack(_LAYER.format, f"chunk layer {i}")) for i in range(n_layer)
    )
    layout = KVLayout(bool(flags & 1), layers)
    if flags & ~1 or layout != expect:
        raise StateError(f"chunk layout {layout} is not the model's {expect}")
    k = tuple(r.rows((n, la.k_row), "chunk K") for la in layers)
    if layout.v_trans:
        v = tuple(r.rows((la.v_embd, n, la.v_el), "chunk V") for la in layers)
    else:
        v = tuple(r.rows((n, la.v_row), "chunk V") for la in layers)
    if r.at != len(r.buf):
        raise StateError(f"chunk has {len(r.buf) - r.at} bytes more than its header says")
    return Chunk(n, k, v)


def assemble(
    payloads: Sequence[bytes | bytearray | memoryview],
    n_tokens: int,
    layout: KVLayout,
    seq_id: int = 0,
    arch: str | None = None,
) -> bytearray:
    """The state of positions ``0 … n_tokens-1`` from consecutive chunks (the last one may be
    used in part): the sequence form for ``llama_state_seq_set_data``, or with ``arch`` the
    whole-context form for ``llama_state_set_data``."""
    chunks = [parse_chunk(p, layout) for p in payloads]
    if sum(c.n_tokens for c in chunks) < n_tokens or n_tokens < 1:
        raise StateError(f"{len(chunks)} chunks do not hold {n_tokens} tokens")
    if arch is None:
        head = struct.pack("<Ii", SEQ_MAGIC, seq_id)
    else:
        name = arch.encode()
        head = struct.pack("<I", len(name)) + name
    head += struct.pack("<II", 1, n_tokens)
    out = bytearray(len(head) + _state_body_size(layout, n_tokens))
    out[: len(head)] = head
    at = len(head)
    meta = np.frombuffer(memoryview(out)[at : at + n_tokens * _CELL.itemsize], dtype=_CELL)
    meta["pos"] = np.arange(n_tokens)
    meta["n_seq"] = 1
    meta["seq"] = seq_id
    at += meta.nbytes
    struct.pack_into("<II", out, at, int(layout.v_trans), len(layout.layers))
    at += 8
    for il, la in enumerate(layout.layers):
        struct.pack_into("<iQ", out, at, la.k_type, la.k_row)
        at = _fill(out, at + 12, [c.k[il] for c in chunks], (n_tokens, la.k_row), 0)
    for il, la in enumerate(layout.layers):
        if layout.v_trans:
            struct.pack_into("<iII", out, at, la.v_type, la.v_el, la.v_embd)
            shape = (la.v_embd, n_tokens, la.v_el)
            at = _fill(out, at + 12, [c.v[il] for c in chunks], shape, 1)
        else:
            struct.pack_into("<iQ", out, at, la.v_type, la.v_row)
            at = _fill(out, at + 12, [c.v[il] for c in chunks], (n_tokens, la.v_row), 0)
    assert at == len(out)
    return out


def _state_body_size(layout: KVLayout, n_tokens: int) -> int:
    return n_tokens * (_CELL.itemsize + layout.cell_bytes) + 8 + 24 * len(layout.layers)


def _fill(
    out: bytearray, at: int, parts: list[np.ndarray], shape: tuple[int, ...], axis: int
) -> int:
    """Copy the token ranges ``parts`` (cut along ``axis``) into ``out[at:]`` of ``shape``."""
    nbytes = int(np.prod(shape))
    dst = np.frombuffer(memoryview(out)[at : at + nbytes], dtype=np.uint8).reshape(shape)
    t = 0
    for p in parts:
        take = min(p.shape[axis], shape[axis] - t)
        if take <= 0:
            break
        if axis == 0:
            dst[t : t + take] = p[:take]
        else:
            dst[:, t : t + take] = p[:, :take]
        t += take
    return at + nbytes
