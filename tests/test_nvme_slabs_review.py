"""NVMe slab files under adversarial conditions found in review: a wall clock that steps back
between (or during) runs, and index updates racing the start-up rebuild."""

from __future__ import annotations

import asyncio
import time
import types
from pathlib import Path

import pytest

from kvstrata.tiers import _nvme_slabs
from kvstrata.tiers.nvme import NvmeTier
from tests.test_nvme_slabs import chunk, read, run

HOUR_NS = 3600 * 10**9


def _clock_back(monkeypatch: pytest.MonkeyPatch, by_ns: int) -> None:
    """The slab writer's wall clock reads ``by_ns`` earlier (NTP step, VM restore, new host)."""
    fake = types.SimpleNamespace(time_ns=lambda: time.time_ns() - by_ns)
    monkeypatch.setattr(_nvme_slabs, "time", fake)


def test_overwrite_cut_after_the_clock_stepped_back_keeps_the_newer_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run 1 writes a chunk. Run 2 starts with the wall clock an hour earlier and overwrites
    it, but is killed between writing the new slot and invalidating the old one (two valid
    slots). Run 3 must serve the newer bytes: the generation that orders two slots of one
    chunk has to be above every generation on disk, whatever the clock says."""
    old, old_data = chunk(1, 20_000)
    new, new_data = chunk(1, 20_000, seed=9)

    async def first(tier: NvmeTier) -> None:
        await tier.put(old, old_data)

    async def cut_overwrite(tier: NvmeTier) -> None:
        assert await read(tier, old) == old_data
        await asyncio.get_running_loop().run_in_executor(
            None, tier._slabs.write, new, memoryview(new_data), False
        )

    async def third(tier: NvmeTier) -> None:
        assert tier.rebuild_report is not None and tier.rebuild_report.stale == 1
        assert await read(tier, new) == new_data

    run(tmp_path, first)
    with monkeypatch.context() as m:
        _clock_back(m, HOUR_NS)
        run(tmp_path, cut_overwrite)
    run(tmp_path, third)


def test_clock_step_back_within_a_run_keeps_the_newer_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within one run the clock steps back between two writes of one chunk, and the process
    dies before the first copy is invalidated: the restart keeps the second copy."""
    old, old_data = chunk(2, 9_000)
    new, new_data = chunk(2, 9_000, seed=3)

    async def both(tier: NvmeTier) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, tier._slabs.write, old, memoryview(old_data), False)
        with monkeypatch.context() as m:
            _clock_back(m, HOUR_NS)
            await loop.run_in_executor(None, tier._slabs.write, new, memoryview(new_data), False)

    async def after(tier: NvmeTier) -> None:
        assert await read(tier, new) == new_data

    run(tmp_path, both, scan=False)
    run(tmp_path, after)
