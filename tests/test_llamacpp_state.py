"""The llama.cpp state codec (``kvstrata.clients.llamacpp_state``) against states written the
way llama.cpp's ``state_write`` writes them (``tests/llamacpp_writer.py``): cut into chunks and
assembled back, byte for byte what llama.cpp writes for that prefix; every malformed, truncated
or foreign state and chunk refused."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from kvstrata.clients.llamacpp_state import (
    KVLayout,
    StateError,
    assemble,
    encode_chunk,
    parse_chunk,
    parse_state,
)
from tests.llamacpp_writer import FakeKVCache

C = 16  # chunk tokens (256 in the adapter; small here to keep states small)


def layout_of(cache: FakeKVCache) -> KVLayout:
    return KVLayout.expected(
        cache.n_layer, cache.n_embd_k, cache.n_embd_v, cache.k_type, cache.v_type, cache.v_trans
    )


def chunks_of(state_bytes: bytes, n: int, expect: KVLayout) -> list[bytearray]:
    st = parse_state(state_bytes, expect)
    return [encode_chunk(st, a, min(a + C, n)) for a in range(0, n, C)]


def prefix_cache(cache: FakeKVCache, n: int) -> FakeKVCache:
    """The same cache holding only positions < n of sequence 0."""
    cut = FakeKVCache(
        cache.kv_size,
        cache.n_layer,
        cache.n_embd_k,
        cache.n_embd_v,
        cache.k_type,
        cache.v_type,
        cache.v_trans,
        cache.n_seq_max,
    )
    cut.pos, cut.seqs, cut.k, cut.v = (
        list(cache.pos),
        [set(s) for s in cache.seqs],
        cache.k,
        cache.v,
    )
    cut.seq_rm(0, n)
    return cut


@pytest.mark.parametrize("v_trans", [True, False])
@pytest.mark.parametrize("n", [C, 3 * C, 3 * C - 5, 1])
def test_cut_and_assemble_is_what_llama_cpp_writes_for_the_prefix(v_trans: bool, n: int) -> None:
    """Cells in order: chunks of every full range plus a part, assembled for ``n`` tokens, are
    byte for byte the state llama.cpp writes when only those ``n`` tokens are cached."""
    cache = FakeKVCache(kv_size=4 * C, v_trans=v_trans)
    cache.decode(0, range(3 * C + 7))
    expect = layout_of(cache)
    chunks = chunks_of(cache.seq_state(0), 3 * C + 7, expect)
    got = assemble(chunks[: (n + C - 1) // C], n, expect)
    assert bytes(got) == prefix_cache(cache, n).seq_state(0)


def test_cells_out_of_order_and_other_sequences() -> None:
    """A cache whose cells were reused (another sequence, removed tokens): the sequence's cells
    are found by position, and the assembled state is the one of an in-order cache."""
    cache = FakeKVCache(kv_size=6 * C, n_seq_max=2, v_trans=True)
    cache.decode(0, range(20))
    cache.decode(1, range(20))
    cache.decode(0, range(20, 40))
    cache.seq_rm(1, 0)  # frees cells 20..39: positions 40..59 land before 20..39
    cache.decode(0, range(40, 60))
    expect = layout_of(cache)
    st = parse_state(cache.seq_state(0), expect)
    assert not np.array_equal(st.positions, np.arange(60))
    chunks = [encode_chunk(st, a, a + C) for a in range(0, 48, C)]
    back = parse_state(assemble(chunks, 48, expect), expect)
    assert np.array_equal(back.positions, np.arange(48))
    order = np.argsort(st.positions)
    for il in range(cache.n_layer):
        assert np.array_equal(back.k[il], st.k[il][order[:48]])
        assert np.array_equal(back.v[il], st.v[il][:, order[:48], :])


def test_whole_context_form_round_trips() -> None:
    """``llama_state_get_data`` (what ``Llama.save_state`` keeps): arch string, seq_id -1."""
    cache = FakeKVCache(kv_size=3 * C, v_trans=False, k_type=8, n_embd_k=64)  # q8_0 keys
    cache.decode(0, range(2 * C + 3))
    expect = layout_of(cache)
    st = parse_state(cache.context_state("llama"), expect, context=True)
    assert st.arch == "llama" and st.seq_id is None
    chunks = [encode_chunk(st, 0, C), encode_chunk(st, C, 2 * C)]
    got = assemble(chunks, 2 * C, expect, arch="llama")
    assert bytes(got) == prefix_cache(cache, 2 * C).context_state("llama")


def test_every_truncation_and_any_extra_byte_is_refused() -> None:
    cache = FakeKVCache(kv_size=8, n_layer=1, n_embd_k=4, n_embd_v=4)
    cache.decode(0, range(5))
    data = cache.seq_state(0)
    parse_state(data, layout_of(cache))
    for cut in range(len(data)):
        with pytest.raises(StateError):
            parse_state(data[:cut])
    with pytest.raises(StateError, match="left over"):
        parse_state(data + b"\0")


def test_foreign_states_are_refused() -> None:
    cache = FakeKVCache(kv_size=2 * C)
    cache.decode(0, range(C))
    good = cache.seq_state(0)
    with pytest.raises(StateError, match="magic"):
        parse_state(b"\0\0\0\0" + good[4:])
    with pytest.raises(StateError, match="2 KV streams"):
        parse_state(good[:8] + struct.pack("<I", 2) + good[12:])
    other = FakeKVCache(kv_size=2 * C, v_trans=False)
    with pytest.raises(StateError, match="not the model"):
        parse_state(good, layout_of(other))
    with pytest.raises(StateError, match="no cells"):
        parse_state(FakeKVCache(kv_size=4).seq_state(0))


def test_shared_cells_and_per_cell_extras_are_refused() -> None:
    shared = FakeKVCache(kv_size=2 * C, n_seq_max=2)
    shared.decode(0, range(C))
    shared.seqs[3].add(1)  # llama_memory_seq_cp: a cell of two sequences
    with pytest.raises(StateError, match="several sequences"):
        parse_state(shared.context_state(), context=True)
    mrope = FakeKVCache(kv_size=2 * C, cell_ext=True)
    mrope.decode(0, range(C))
    with pytest.raises(StateError):
        parse_state(mrope.seq_state(0))


def test_gaps_in_positions_are_refused() -> None:
    cache = FakeKVCache(kv_size=3 * C)
    cache.decode(0, [*range(10), *range(11, 2 * C)])
    st = parse_state(cache.seq_state(0))
    encode_chunk(st, 0, 10)
    with pytest.raises(StateError, match="once each"):
        encode_chunk(st, 0, C)


def test_chunks_altered_truncated_or_of_another_layout_are_refused() -> None:
    cache = FakeKVCache(kv_size=2 * C)
    cache.decode(0, range(C))
    expect = layout_of(cache)
    (chunk,) = chunks_of(cache.seq_state(0), C, expect)
    parse_chunk(chunk, expect)
    with pytest.raises(StateError, match="more than"):
        parse_chunk(bytes(chunk) + b"\0", expect)
    with pytest.raises(StateError, match="truncated"):
        parse_chunk(chunk[:-1], expect)
    with pytest.raises(StateError, match="magic"):
        parse_chunk(b"XXXX" + chunk[4:], expect)
    bent = bytearray(chunk)
    bent[6] = 0  # flags: v_trans off
    with pytest.raises(StateError, match="not the model"):
        parse_chunk(bent, expect)
    with pytest.raises(StateError, match="do not hold"):
        assemble([chunk], C + 1, expect)
