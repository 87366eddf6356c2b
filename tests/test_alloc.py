"""Offset allocator: alignment, best fit, coalescing, and random sequences (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.tiers.alloc import OffsetAllocator

A = 4096


def check_invariants(alloc: OffsetAllocator) -> None:
    """Slots and free extents tile [0, capacity) exactly, without overlap, coalesced."""
    pieces = [(o, s, "used") for o, s in alloc.allocations()]
    pieces += [(o, s, "free") for o, s in alloc.free_extents()]
    pieces.sort()
    pos = 0
    prev_kind = ""
    for offset, size, kind in pieces:
        assert offset == pos, f"gap or overlap at {offset} (expected {pos})"
        assert offset % A == 0 and size % A == 0 and size > 0
        assert not (kind == prev_kind == "free"), "two adjacent free extents were not merged"
        pos += size
        prev_kind = kind
    assert pos == alloc.capacity
    assert alloc.used == sum(s for _, s in alloc.allocations())
    assert alloc.used + alloc.free_bytes == alloc.capacity
    assert alloc.largest_free == max((s for _, s in alloc.free_extents()), default=0)


def test_sizes_are_rounded_and_offsets_aligned() -> None:
    alloc = OffsetAllocator(10 * A)
    a = alloc.allocate(1)
    b = alloc.allocate(A + 1)
    c = alloc.allocate(0)
    assert (a, b, c) == (0, A, 3 * A)
    assert alloc.size_of(A) == 2 * A
    assert alloc.used == 4 * A
    check_invariants(alloc)


def test_capacity_tail_shorter_than_alignment_is_unused() -> None:
    alloc = OffsetAllocator(3 * A + 100)
    assert alloc.capacity == 3 * A
    assert alloc.allocate(3 * A) == 0
    assert alloc.allocate(1) is None


def test_full_returns_none_and_free_restores() -> None:
    alloc = OffsetAllocator(4 * A)
    offs = [alloc.allocate(A) for _ in range(4)]
    assert None not in offs
    assert alloc.allocate(1) is None
    assert alloc.free_bytes == 0 and alloc.fragmentation == 0.0
    for o in offs:
        assert o is not None
        alloc.free(o)
    assert alloc.free_extents() == [(0, 4 * A)]


def test_best_fit_picks_smallest_hole() -> None:
    """Holes of 3, 1 and 2 units: a 1-unit request lands in the 1-unit hole."""
    alloc = OffsetAllocator(20 * A)
    slots = [alloc.allocate(n * A) for n in (3, 1, 1, 1, 2, 1)]
    assert all(s is not None for s in slots)
    for i in (0, 2, 4):
        s = slots[i]
        assert s is not None
        alloc.free(s)
    assert alloc.allocate(A) == slots[2]
    assert alloc.allocate(2 * A) == slots[4]
    assert alloc.allocate(3 * A) == slots[0]
    check_invariants(alloc)


def test_fragmentation_and_largest_free() -> None:
    alloc = OffsetAllocator(4 * A)
    offs = [alloc.allocate(A) for _ in range(4)]
    alloc.free(offs[0])  # type: ignore[arg-type]
    alloc.free(offs[2])  # type: ignore[arg-type]
    assert alloc.largest_free == A
    assert alloc.fragmentation == pytest.approx(0.5)
    assert alloc.allocate(2 * A) is None  # enough bytes, no extent large enough
    st_ = alloc.stats()
    assert (st_.used, st_.free_extents, st_.allocations) == (2 * A, 2, 2)


def test_double_free_and_unknown_offset_raise() -> None:
    alloc = OffsetAllocator(4 * A)
    off = alloc.allocate(A)
    assert off is not None
    alloc.free(off)
    with pytest.raises(ValueError):
        alloc.free(off)
    with pytest.raises(ValueError):
        alloc.free(123)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        OffsetAllocator(A, alignment=3000)
    with pytest.raises(ValueError):
        OffsetAllocator(-1)
    with pytest.raises(ValueError):
        OffsetAllocator(A).allocate(-5)
    assert OffsetAllocator(0).allocate(1) is None


ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 9 * A)),
        st.tuples(st.just("free"), st.integers(0, 10**6)),
    ),
    max_size=120,
)


@settings(max_examples=150, deadline=None)
@given(capacity_units=st.integers(0, 64), seq=ops)
def test_random_sequences_keep_invariants(capacity_units: int, seq: list[tuple[str, int]]) -> None:
    """Random alloc/free: slots never overlap, never exceed capacity, and coalesce back."""
    alloc = OffsetAllocator(capacity_units * A)
    live: dict[int, int] = {}
    for op, n in seq:
        if op == "alloc":
            off = alloc.allocate(n)
            if off is None:
                assert alloc.largest_free < alloc.round_up(n)
                continue
            assert off % A == 0 and off + alloc.round_up(n) <= alloc.capacity
            for o, s in live.items():
                assert off + alloc.round_up(n) <= o or o + s <= off
            live[off] = alloc.round_up(n)
        elif live:
            victim = sorted(live)[n % len(live)]
            assert alloc.free(victim) == live.pop(victim)
        check_invariants(alloc)
    for off in list(live):
        alloc.free(off)
    expected = [(0, alloc.capacity)] if alloc.capacity else []
    assert alloc.free_extents() == expected
    assert alloc.used == 0 and alloc.fragmentation == 0.0
