"""RecentHits, the vLLM tier's memory of recent hits (issue 31): a key hits until ``ttl_s`` after
it was last seen stored, at most ``max_keys`` are kept (the oldest leave first), forgotten keys
and a cleared cache miss, and a zero TTL or size turns it off. Time comes from an injected
clock; the tier's behaviour against a real server is in tests/engines/vllm."""

from __future__ import annotations

import pytest

from kvstrata.clients.vllm_lookup import RecentHits, group_chains


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_hits_expire_after_ttl_and_are_renewed_when_seen_again() -> None:
    clock = Clock()
    hits = RecentHits(2.0, 10, clock)
    hits.add([b"a", b"b"])
    clock.now += 1.5
    hits.add([b"a"])
    assert hits.hit(b"a") and hits.hit(b"b") and not hits.hit(b"c")
    clock.now += 1.0
    assert hits.hit(b"a") and not hits.hit(b"b")
    assert len(hits) == 1  # the expired key left on its first miss


def test_bound_forget_clear_and_off() -> None:
    hits = RecentHits(60.0, 3, Clock())
    hits.add([b"1", b"2", b"3"])
    hits.add([b"1", b"4"])  # 1 renewed: 2 is the oldest and leaves
    assert [hits.hit(k) for k in (b"1", b"2", b"3", b"4")] == [True, False, True, True]
    many = RecentHits(60.0, 3, Clock())
    many.add([b"a", b"b", b"c", b"d", b"e"])  # more than fit at once: the last 3 stay
    many.add([b"c"])  # renewed: d is now the oldest
    many.add([b"f"])
    assert [many.hit(k) for k in (b"a", b"b", b"c", b"d", b"e", b"f")] == [
        False, False, True, False, True, True,
    ]  # fmt: skip
    hits.forget([b"3", b"nope"])
    assert not hits.hit(b"3") and hits.hit(b"4")
    hits.clear()
    assert len(hits) == 0
    for off in (RecentHits(0.0, 10), RecentHits(5.0, 0)):
        off.add([b"x"])
        assert not off.enabled and not off.hit(b"x")
    with pytest.raises(ValueError):
        RecentHits(-1.0, 10)


def test_group_chains_orders_each_kv_group_by_position() -> None:
    g0, g1 = (0).to_bytes(4, "big"), (1).to_bytes(4, "big")
    a, b, c = b"a" * 32 + g0, b"b" * 32 + g0, b"c" * 32 + g1
    positions = {b: 32, a: 16, c: 16}
    assert group_chains([b, c, a], positions) == [[a, b], [c]]
    assert group_chains([a, b], positions) == [[a, b]]  # one group, in order
    assert group_chains([b, a], positions) == [[a, b]]  # one group, reversed (sliding window)
    d = b"d" * 32 + g0  # no position: first, the others keep their order
    assert group_chains([b, d, a], positions) == [[d, a, b]]
