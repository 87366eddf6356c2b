"""A stand-in for llama.cpp's ``llama_kv_cache`` that writes its state the way
``llama_kv_cache::state_write`` of the llama.cpp vendored by llama-cpp-python 0.3.36 does
(``src/llama-kv-cache.cpp``: cell ranges, ``state_write_meta``, ``state_write_data`` with V rows
or V transposed over the whole ``kv_size``), plus the headers of ``llama_state_seq_get_data``
and ``llama_state_get_data`` (``src/llama-context.cpp``). Written loop for loop from the C++,
apart from the codec under test, so the codec's unit tests need no llama.cpp."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from kvstrata.clients.llamacpp_state import GGML_TYPES, SEQ_MAGIC


def _row(ggml_type: int, n: int) -> int:
    _, size, block = GGML_TYPES[ggml_type]
    return n // block * size


@dataclass
class FakeKVCache:
    kv_size: int
    n_layer: int = 2
    n_embd_k: int = 64
    n_embd_v: int = 64
    k_type: int = 1
    v_type: int = 1
    v_trans: bool = True
    n_seq_max: int = 1
    n_stream: int = 1
    cell_ext: bool = False  # M-RoPE / PLE caches write 12 more bytes per cell
    seed: int = 0
    pos: list[int | None] = field(init=False)
    seqs: list[set[int]] = field(init=False)
    k: list[np.ndarray] = field(init=False)
    v: list[np.ndarray] = field(init=False)

    def __post_init__(self) -> None:
        self.pos = [None] * self.kv_size
        self.seqs = [set() for _ in range(self.kv_size)]
        self.rng = np.random.default_rng(self.seed)
        kr = _row(self.k_type, self.n_embd_k)
        self.k = [np.zeros((self.kv_size, kr), np.uint8) for _ in range(self.n_layer)]
        if self.v_trans:
            el = _row(self.v_type, 1)
            self.v = [
                np.zeros(self.n_embd_v * self.kv_size * el, np.uint8) for _ in range(self.n_layer)
            ]
        else:
            vr = _row(self.v_type, self.n_embd_v)
            self.v = [np.zeros((self.kv_size, vr), np.uint8) for _ in range(self.n_layer)]

    def decode(self, seq: int, positions: range) -> None:
        """Put one token per position in the first free cells, with random K/V bytes."""
        free = iter([i for i in range(self.kv_size) if self.pos[i] is None])
        for p in positions:
            i = next(free)
            self.pos[i] = p
            self.seqs[i] = {seq}
            for il in range(self.n_layer):
                self.k[il][i] = self.rng.integers(0, 256, self.k[il].shape[1], dtype=np.uint8)
                if self.v_trans:
                    el = _row(self.v_type, 1)
                    for j in range(self.n_embd_v):
                        at = (i + j * self.kv_size) * el
                        self.v[il][at : at + el] = self.rng.integers(0, 256, el, dtype=np.uint8)
                else:
                    self.v[il][i] = self.rng.integers(0, 256, self.v[il].shape[1], dtype=np.uint8)

    def seq_rm(self, seq: int, p0: int) -> None:
        for i in range(self.kv_size):
            p = self.pos[i]
            if p is not None and seq in self.seqs[i] and p >= p0:
                self.seqs[i].discard(seq)
                if not self.seqs[i]:
                    self.pos[i] = None

    # -- what llama.cpp writes --------------------------------------------------------------

    def seq_state(self, seq_id: int) -> bytes:
        return struct.pack("<Ii", SEQ_MAGIC, seq_id) + self.state_write(seq_id)

    def context_state(self, arch: str = "llama") -> bytes:
        name = arch.encode()
        return struct.pack("<I", len(name)) + name + self.state_write(-1)

    def state_write(self, seq_id: int) -> bytes:
        out = [struct.pack("<I", self.n_stream)]
        for s in range(self.n_stream):
            ranges: list[tuple[int, int]] = []
            begin = None
            count = 0
            for i in range(self.kv_size):
                add = (
                    s == 0 and self.pos[i] is not None and (seq_id == -1 or seq_id in self.seqs[i])
                )
                if add:
                    count += 1
                    begin = i if begin is None else begin
                elif begin is not None:
                    ranges.append((begin, i))
                    begin = None
            if begin is not None:
                ranges.append((begin, self.kv_size))
            out.append(struct.pack("<I", count))
            if count == 0:
                continue
            out += self._meta(ranges, seq_id)
            out += self._data(ranges)
        return b"".join(out)

    def _meta(self, ranges: list[tuple[int, int]], seq_id: int) -> list[bytes]:
        out = []
        for a, b in ranges:
            for i in range(a, b):
                ids = [
                    c
                    for c in range(self.n_seq_max)
                    if (c == seq_id or seq_id == -1) and c in self.seqs[i]
                ]
                out.append(struct.pack("<iI", self.pos[i], len(ids)))
                if self.cell_ext:
                    out.append(struct.pack("<iii", 0, 0, 7))
                out += [struct.pack("<i", c) for c in ids]
        return out

    def _data(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        out = [struct.pack("<II", int(self.v_trans), self.n_layer)]
        for il in range(self.n_layer):
            k_row = _row(self.k_type, self.n_embd_k)
            out.append(struct.pack("<iQ", self.k_type, k_row))
            out += [self.k[il][a:b].tobytes() for a, b in ranges]
        if not self.v_trans:
            for il in range(self.n_layer):
                out.append(struct.pack("<iQ", self.v_type, _row(self.v_type, self.n_embd_v)))
                out += [self.v[il][a:b].tobytes() for a, b in ranges]
        else:
            el = _row(self.v_type, 1)
            for il in range(self.n_layer):
                out.append(struct.pack("<iII", self.v_type, el, self.n_embd_v))
                for j in range(self.n_embd_v):
                    for a, b in ranges:
                        at = (a + j * self.kv_size) * el
                        out.append(self.v[il][at : at + (b - a) * el].tobytes())
        return out
