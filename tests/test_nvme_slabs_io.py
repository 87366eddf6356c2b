"""NVMe slab files, continued: the config key, the kvikio backend's slot I/O (over a stand-in
for ``kvikio.CuFile``), and a read racing an overwrite of the same chunk."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstrata.chunks import ChunkMeta
from kvstrata.config import load_config
from kvstrata.tiers.nvme import NvmeConfig, NvmeTier
from tests.test_nvme_slabs import KiB, MiB, chunk, read, run


def test_slab_max_comes_from_the_config() -> None:
    cfg = load_config(flags={"nvme-slab-max": "256KiB"}, env={})
    assert NvmeConfig.from_config(cfg).slab_max == 256 * KiB
    with pytest.raises(ValueError, match="nvme-slab-max"):
        NvmeConfig("/tmp", slab_max=8 * MiB)


class _FakeCuFile:
    """Enough of ``kvikio.CuFile`` (plain file I/O, modes r, r+, w) to run the kvikio backend's
    slot I/O without CUDA."""

    def __init__(self, path: str, mode: str) -> None:
        self._f = open(path, {"r": "rb", "r+": "r+b", "w": "w+b"}[mode])  # noqa: SIM115

    def __enter__(self) -> _FakeCuFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()

    def pwrite(self, buf: Any, size: int, offset: int) -> Any:
        n = os.pwrite(self._f.fileno(), memoryview(buf)[:size], offset)
        return type("Done", (), {"get": lambda _: n})()

    def pread(self, buf: Any, size: int, offset: int) -> Any:
        n = os.preadv(self._f.fileno(), [memoryview(buf)[:size]], offset)
        return type("Done", (), {"get": lambda _: n})()


def test_kvikio_backend_writes_and_reads_slots_in_the_same_format(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slots written through the kvikio backend are read back by the POSIX backend after a
    restart (one on-disk format), and the other way round."""
    from kvstrata.tiers._nvme_io import KvikioBackend

    monkeypatch.setitem(sys.modules, "kvikio", type(sys)("kvikio"))
    monkeypatch.setattr(sys.modules["kvikio"], "CuFile", _FakeCuFile, raising=False)
    (a, a_data), (b, b_data) = chunk(1, 12_345), chunk(2, 300_000)

    async def with_kvikio(tier: NvmeTier) -> None:
        tier.backend = tier._slabs.backend = KvikioBackend()
        await tier.put(a, a_data)
        assert await read(tier, a) == a_data

    async def with_posix(tier: NvmeTier) -> None:
        assert tier.backend.name == "posix" and await read(tier, a) == a_data
        await tier.put(b, b_data)

    async def kvikio_again(tier: NvmeTier) -> None:
        tier.backend = tier._slabs.backend = KvikioBackend()
        assert await read(tier, b) == b_data and await read(tier, a) == a_data

    run(tmp_path, with_kvikio, backend="posix", direct="no")
    run(tmp_path, with_posix, backend="posix")
    run(tmp_path, kvikio_again, backend="posix")


def test_read_racing_an_overwrite_reads_the_new_slot(tmp_path: Path) -> None:
    """A read starts on a chunk's slot; before it reads, an overwrite of the chunk publishes a
    new slot and invalidates (frees) the old one. The read does not report a miss for a chunk
    that is there: it follows the index to the new slot and returns the new bytes."""
    old, old_data = chunk(1, 40_000)
    new, new_data = chunk(1, 40_000, seed=4)

    async def body(tier: NvmeTier) -> None:
        await tier.put(old, old_data)
        loop = asyncio.get_running_loop()
        real = tier._slabs.read
        calls = []

        def read(*args: Any) -> ChunkMeta:
            if not calls:  # the first read: let the overwrite finish before it reads
                asyncio.run_coroutine_threadsafe(tier.put(new, new_data), loop).result()
            calls.append(args[1])
            return real(*args)

        tier._slabs.read = read  # type: ignore[method-assign]
        assert await read_chunk(tier, new) == new_data
        assert len(calls) == 2 and calls[0] != calls[1]
        assert tier.stats.integrity_errors == 0 and tier.info()["slots_invalid"] == 0

    run(tmp_path, body)


async def read_chunk(tier: NvmeTier, meta: ChunkMeta) -> bytes:
    out = bytearray(meta.size)
    got = await tier.get(meta.key, memoryview(out))
    assert got.key == meta.key and got.checksum == meta.checksum
    return bytes(out)
