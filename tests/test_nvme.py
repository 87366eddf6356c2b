"""NVMe tier specifics: restart, integrity, quarantine, injected I/O failures, kill -9.

These tests pin the chunk-file layout (chunks over ``nvme-slab-max``, and files left by older
versions): ``new_tier`` turns slabs off unless a test asks; slabs are in test_nvme_slabs.py.
The kill -9 writer keeps the default, so its burst mixes slab slots and files."""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.tiers import _nvme_format as fmt
from kvstrata.tiers._nvme_sync import POLICIES, SYNC_MARKER, GroupSync
from kvstrata.tiers.base import (
    ChunkMissing,
    IntegrityError,
    TierIOError,
    TierUnavailable,
    build_tier,
)
from kvstrata.tiers.checksum import checksum
from kvstrata.tiers.nvme import NvmeConfig, NvmeTier

MiB = 1024 * 1024
NS = "nvme@test"


def chunk(i: int, size: int) -> tuple[ChunkMeta, bytes]:
    data = np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()
    key = ChunkKey(NS, i.to_bytes(4, "big") * 8)
    return ChunkMeta(key, b"", i, size, checksum(data)), data


def new_tier(root: Path, **kw: Any) -> NvmeTier:
    kw.setdefault("capacity", 64 * MiB)
    kw.setdefault("io_threads", 2)
    kw.setdefault("slab_max", 0)
    return NvmeTier(NvmeConfig(str(root), **kw))


def run(root: Path, body: Callable[[NvmeTier], Awaitable[None]], **kw: Any) -> None:
    async def main() -> None:
        tier = new_tier(root, **kw)
        try:
            await body(tier)
        finally:
            await tier.close()

    asyncio.run(main())


async def scan_all(tier: NvmeTier) -> list[ChunkMeta]:
    return [m async for m in tier.scan()]


def chunk_files(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("??/*") if p.is_file())


def test_restart_scan_returns_what_was_stored(tmp_path: Path) -> None:
    """Store chunks, close, open a new tier on the folder: scan() lists them all, bytes intact."""
    items = [chunk(i, s) for i, s in enumerate([1, 4096, 5000, MiB + 7])]

    async def write(tier: NvmeTier) -> None:
        await tier.put_many(items)

    async def reopen(tier: NvmeTier) -> None:
        assert not await tier.contains(items[0][0].key)  # nothing known before scan()
        found = await scan_all(tier)
        assert sorted(found, key=lambda m: m.tokens) == [m for m, _ in items]
        report = tier.rebuild_report
        assert report is not None
        assert (report.chunks, report.bytes, report.quarantined) == (
            4,
            sum(m.size for m, _ in items),
            0,
        )
        assert tier.used == sum(fmt.file_bytes(m.size) for m, _ in items)
        for meta, data in items:
            out = bytearray(meta.size)
            assert await tier.get(meta.key, memoryview(out)) == meta
            assert out == data
        assert tier.info()["rebuild_chunks"] == 4

    run(tmp_path, write)
    run(tmp_path, reopen)


def test_file_names_come_from_digests_only(tmp_path: Path) -> None:
    async def body(tier: NvmeTier) -> None:
        data = b"abc"
        key = ChunkKey("../../etc/passwd", b"\x00/..")
        await tier.put(ChunkMeta(key, b"", 1, 3, checksum(data)), data)
        (path,) = chunk_files(tmp_path)
        digest = fmt.chunk_digest(key)
        assert path == tmp_path / digest[:2] / f"{digest}.kvc"
        raw = path.read_bytes()
        assert len(raw) == fmt.HEADER_SIZE + 3 and raw[:8] == b"KVSTRAT1"
        assert fmt.decode_header(raw[: fmt.HEADER_SIZE]).meta.key == key

    run(tmp_path, body)


def test_flipped_payload_byte_is_a_miss_and_quarantined(tmp_path: Path) -> None:
    """One payload bit flipped on disk: the next get raises IntegrityError, never wrong bytes."""

    async def body(tier: NvmeTier) -> None:
        meta, data = chunk(1, 100_000)
        await tier.put(meta, data)
        (path,) = chunk_files(tmp_path)
        with open(path, "r+b") as f:
            f.seek(fmt.HEADER_SIZE + 54_321)
            byte = f.read(1)
            f.seek(fmt.HEADER_SIZE + 54_321)
            f.write(bytes([byte[0] ^ 0x01]))
        with pytest.raises(IntegrityError):
            await tier.get(meta.key, memoryview(bytearray(meta.size)))
        assert not path.exists()
        assert len(list((tmp_path / "quarantine").iterdir())) == 1
        assert not await tier.contains(meta.key) and tier.used == 0
        assert tier.stats.integrity_errors == 1 and tier.stats.extra["quarantined"] == 1

    run(tmp_path, body)


def test_scan_quarantines_bad_files_and_removes_temp_files(tmp_path: Path) -> None:
    """Truncated, foreign, misplaced and corrupt-header files are quarantined; temp files go."""
    good, good_data = chunk(1, 20_000)
    trunc, trunc_data = chunk(2, 20_000)
    bad_head, bad_head_data = chunk(3, 100)

    async def write(tier: NvmeTier) -> None:
        await tier.put_many([(good, good_data), (trunc, trunc_data), (bad_head, bad_head_data)])

    run(tmp_path, write)
    rel = fmt.chunk_relpath
    os.truncate(tmp_path / rel(trunc.key), fmt.HEADER_SIZE + 10_000)
    with open(tmp_path / rel(bad_head.key), "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    (tmp_path / "ab" / "notes.txt").write_text("foreign")
    (tmp_path / "cd" / ("0" * 64 + ".kvc")).write_bytes(b"garbage" * 1000)
    misplaced = tmp_path / "ef" / ("e" * 64 + ".kvc")
    misplaced.write_bytes((tmp_path / rel(good.key)).read_bytes())
    (tmp_path / "stray.bin").write_bytes(b"x")
    (tmp_path / "12" / ".x.kvc.999.1.tmp").write_bytes(b"half")

    async def reopen(tier: NvmeTier) -> None:
        found = await scan_all(tier)
        assert found == [good]
        report = tier.rebuild_report
        assert report is not None
        assert (report.quarantined, report.temp_removed) == (6, 1)
        assert len(list((tmp_path / "quarantine").iterdir())) == 6
        assert chunk_files(tmp_path) == [tmp_path / rel(good.key)]
        out = bytearray(good.size)
        await tier.get(good.key, memoryview(out))
        assert out == good_data

    run(tmp_path, reopen)


@pytest.mark.parametrize("direct", ["auto", "no"])
def test_enospc_on_write_is_counted_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: str
) -> None:
    """The disk fills up mid-write: TierIOError, counters move, no partial file, tier usable."""

    def full(*args: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    async def body(tier: NvmeTier) -> None:
        meta, data = chunk(1, 3 * MiB + 5)
        with monkeypatch.context() as m:
            m.setattr(os, "pwritev", full)
            with pytest.raises(TierIOError, match="ENOSPC"):
                await tier.put(meta, data)
        assert (tier.stats.errors, tier.stats.extra["enospc"], tier.stats.puts) == (1, 1, 0)
        assert list(tmp_path.glob("??/*")) == []  # neither temp nor final file
        assert tier.used == 0 and not await tier.contains(meta.key)
        assert "ENOSPC" in tier.info()["last_error"]
        await tier.put(meta, data)  # the tier keeps working once space is back
        out = bytearray(meta.size)
        await tier.get(meta.key, memoryview(out))
        assert out == data

    run(tmp_path, body, direct=direct)


def test_eio_on_read_and_eacces_on_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def deny(path: Any, *args: Any, **kw: Any) -> int:
        if str(path).endswith(".tmp"):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, *args, **kw)

    def broken(*args: Any) -> int:
        raise OSError(errno.EIO, "Input/output error")

    async def body(tier: NvmeTier) -> None:
        meta, data = chunk(1, 50_000)
        await tier.put(meta, data)
        with monkeypatch.context() as m:
            m.setattr(os, "preadv", broken)
            m.setattr(os, "pread", broken)
            with pytest.raises(TierIOError, match="EIO"):
                await tier.get(meta.key, memoryview(bytearray(meta.size)))
        assert await tier.contains(meta.key)  # an I/O error is not corruption
        other, other_data = chunk(2, 10)
        with monkeypatch.context() as m:
            m.setattr(os, "open", deny)
            with pytest.raises(TierIOError, match="EACCES"):
                await tier.put(other, other_data)
        s = tier.stats
        assert (s.errors, s.extra["eio"], s.extra["eacces"]) == (2, 1, 1)
        out = bytearray(meta.size)
        await tier.get(meta.key, memoryview(out))
        assert out == data

    run(tmp_path, body)


def test_put_refuses_payload_that_fails_its_checksum(tmp_path: Path) -> None:
    async def body(tier: NvmeTier) -> None:
        meta, data = chunk(1, 1000)
        with pytest.raises(IntegrityError):
            await tier.put(meta, data[::-1])
        assert chunk_files(tmp_path) == [] and not await tier.contains(meta.key)

    run(tmp_path, body)


@pytest.mark.parametrize("size", [8 * MiB + 4097, 12_288, 3])
def test_aligned_and_unaligned_buffers(tmp_path: Path, size: int) -> None:
    """Page-aligned and odd-address buffers, through O_DIRECT's direct and staged paths."""

    async def body(tier: NvmeTier) -> None:
        meta, data = chunk(size, size)
        aligned = mmap.mmap(-1, size + 4096)
        aligned[:size] = data
        await tier.put(meta, memoryview(aligned)[:size])
        odd = bytearray(size + 1)
        await tier.get(meta.key, memoryview(odd)[1:])
        assert odd[1:] == data
        out = mmap.mmap(-1, size + 4096)
        await tier.get(meta.key, memoryview(out)[:size])
        assert out[:size] == data
        await tier.put(meta, memoryview(bytearray(b"\0" + data))[1:])
        await tier.get(meta.key, memoryview(out)[:size])
        assert out[:size] == data

    run(tmp_path, body)


def test_folder_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TierUnavailable, match="does not exist"):
        new_tier(tmp_path / "no" / "such" / "dir")
    (tmp_path / "file").write_text("x")
    with pytest.raises(TierUnavailable, match="not a folder"):
        new_tier(tmp_path / "file")

    def deny(folder: str) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", folder)

    monkeypatch.setattr("kvstrata.tiers._nvme_config.probe_writable", deny)
    with pytest.raises(TierUnavailable, match=str(tmp_path / "ro")):
        new_tier(tmp_path / "ro")


def test_backend_choice(tmp_path: Path) -> None:
    tier = new_tier(tmp_path / "a")  # created because its parent exists
    assert tier.info()["backend"] == "posix"
    assert tier.info()["io"] in ("O_DIRECT",) or tier.info()["io"].startswith("buffered")
    asyncio.run(tier.close())
    tier = new_tier(tmp_path / "b", direct="no")
    assert tier.info()["io"].startswith("buffered")
    asyncio.run(tier.close())
    if not os.path.exists("/dev/nvidia0"):
        with pytest.raises(TierUnavailable, match="kvikio"):
            new_tier(tmp_path / "c", backend="kvikio")
    built = build_tier("nvme", NvmeConfig(str(tmp_path / "d"), capacity=MiB))
    assert isinstance(built, NvmeTier)
    asyncio.run(built.close())


_WRITER = textwrap.dedent(
    """
    import asyncio, sys
    import numpy as np
    from kvstrata.chunks import ChunkKey, ChunkMeta
    from kvstrata.tiers.checksum import checksum
    from kvstrata.tiers.nvme import NvmeConfig, NvmeTier

    async def main():
        config = NvmeConfig(sys.argv[1], capacity=1 << 34, io_threads=2, fsync=sys.argv[2])
        tier = NvmeTier(config)
        i = 0
        while True:
            size = 4096 * (1 + i % 7) * 37 + i
            data = np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()
            key = ChunkKey("kill@test", i.to_bytes(8, "big"))
            await tier.put_many([(ChunkMeta(key, b"", i, size, checksum(data)), data)])
            print(i, flush=True)
            i += 1

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("policy", POLICIES)
def test_kill_9_during_write_burst_keeps_only_complete_chunks(tmp_path: Path, policy: str) -> None:
    """A writer is killed with SIGKILL mid-burst, under every fsync policy; a restart serves
    every acknowledged chunk intact, and every chunk scan() reports verifies byte for byte."""
    root = tmp_path / "nvme"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(root), policy],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert proc.stdout is not None
    acked = [int(proc.stdout.readline()) for _ in range(25)]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    assert proc.returncode == -signal.SIGKILL

    async def check(tier: NvmeTier) -> None:
        found = await scan_all(tier)
        tokens = {m.tokens for m in found}
        assert set(acked) <= tokens
        for meta in found:
            i = meta.tokens
            expected = np.random.default_rng(i).integers(0, 256, meta.size, dtype=np.uint8)
            out = np.empty(meta.size, dtype=np.uint8)
            assert await tier.get(meta.key, out.data) == meta
            assert np.array_equal(out, expected)
        assert not list(root.glob("??/*.tmp"))

    run(root, check)


class _FsyncCounter:
    """Stands in for os.fsync: counts calls (from any thread), then syncs for real."""

    def __init__(self, real: Callable[[int], None]) -> None:
        self.real = real
        self.calls = 0

    def __call__(self, fd: int) -> None:
        self.calls += 1
        self.real(fd)


@pytest.mark.parametrize("direct", ["auto", "no"])
def test_fsync_policies_issue_the_syncs_they_claim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: str
) -> None:
    """always: file + folder per put, folder per delete. batch: one marker fsync per group
    pass (plus one per file when writes are buffered), and a put returns only after its pass.
    never: no fsync at all."""
    counter = _FsyncCounter(os.fsync)
    monkeypatch.setattr(os, "fsync", counter)
    items = [chunk(i, 10_000 + i) for i in range(8)]

    async def always(tier: NvmeTier) -> None:
        counter.calls = 0
        for meta, data in items[:3]:
            await tier.put(meta, data)
        assert counter.calls == 6
        await tier.delete(items[0][0].key)
        assert counter.calls == 7

    async def batch(tier: NvmeTier) -> None:
        per_file = 0 if tier.backend.direct else 1
        counter.calls = 0
        for n, (meta, data) in enumerate(items[:3], 1):
            await tier.put(meta, data)  # alone: its own pass, finished before put returns
            assert tier.info()["group_syncs"] == n and counter.calls == n * (1 + per_file)
        counter.calls = 0
        assert await tier.put_many(items[3:]) == [None] * 5
        info = tier.info()
        passes = info["group_syncs"] - 3
        assert 1 <= passes <= 5 and info["group_synced"] == 8
        assert counter.calls == passes + 5 * per_file
        await tier.delete(items[0][0].key)
        assert tier.info()["group_syncs"] == info["group_syncs"] + 1

    async def never(tier: NvmeTier) -> None:
        counter.calls = 0
        await tier.put_many(items)
        await tier.delete(items[0][0].key)
        assert counter.calls == 0
        assert tier.info()["fsync"] == "never"

    for policy, body in (("always", always), ("batch", batch), ("never", never)):
        run(tmp_path / policy, body, fsync=policy, direct=direct)


def test_batch_sync_failure_is_an_error_and_leaves_no_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The group sync fails (EIO): the put raises TierIOError, the unsynced file is removed and
    the chunk is not indexed; the tier works again once syncs do."""

    def broken(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    async def body(tier: NvmeTier) -> None:
        meta, data = chunk(1, 30_000)
        with monkeypatch.context() as m:
            m.setattr(os, "fsync", broken)
            with pytest.raises(TierIOError, match="EIO"):
                await tier.put(meta, data)
        assert not await tier.contains(meta.key) and tier.used == 0
        assert chunk_files(tmp_path) == [] and tier.stats.extra["eio"] == 1
        await tier.put(meta, data)
        out = bytearray(meta.size)
        await tier.get(meta.key, memoryview(out))
        assert out == data

    run(tmp_path, body, fsync="batch")


def test_unknown_fsync_policy_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nvme-fsync"):
        NvmeConfig(str(tmp_path), fsync="sometimes")


async def _until(event: threading.Event) -> None:
    while not event.is_set():
        await asyncio.sleep(0.001)


def test_read_miss_racing_delete_and_put_keeps_the_new_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read finds no file (a delete ran), then a put of the same key finishes before the
    read's miss is handled: the miss does not forget the new chunk, whose file is on disk."""
    meta, data = chunk(1, 20_000)
    new, new_data = chunk(2, 30_000)
    new = ChunkMeta(meta.key, b"", 2, new.size, new.checksum)
    deleted, missed, stored = threading.Event(), threading.Event(), threading.Event()

    async def body(tier: NvmeTier) -> None:
        await tier.put(meta, data)
        real = tier._files.read

        def read(key: ChunkKey, out: memoryview) -> ChunkMeta:
            assert deleted.wait(10)
            try:
                return real(key, out)
            except FileNotFoundError:
                missed.set()
                assert stored.wait(10)
                raise

        monkeypatch.setattr(tier._files, "read", read)
        reading = asyncio.create_task(tier.get(meta.key, memoryview(bytearray(meta.size))))
        await asyncio.sleep(0)
        assert await tier.delete(meta.key)
        deleted.set()
        await _until(missed)
        await tier.put(new, new_data)
        stored.set()
        with pytest.raises(ChunkMissing):
            await reading
        monkeypatch.undo()
        assert await tier.meta(new.key) is not None and tier.used == fmt.file_bytes(new.size)
        out = bytearray(new.size)
        await tier.get(new.key, memoryview(out))
        assert out == new_data

    run(tmp_path, body)


def test_corrupt_read_racing_a_replace_quarantines_only_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read opens a corrupt file; before it verifies, a put replaces the file with a good
    one. The read fails (IntegrityError), but the good file that now has the name is neither
    quarantined nor forgotten."""
    meta, data = chunk(1, 20_000)
    read_done, stored = threading.Event(), threading.Event()

    async def body(tier: NvmeTier) -> None:
        await tier.put(meta, data)
        (path,) = chunk_files(tmp_path)
        with open(path, "r+b") as f:
            f.seek(fmt.HEADER_SIZE + 123)
            f.write(bytes([data[123] ^ 0xFF]))
        backend = tier._files.backend
        real = backend.read_file

        def read_file(*args: Any) -> Any:
            try:
                return real(*args)
            finally:
                read_done.set()
                assert stored.wait(10)

        monkeypatch.setattr(backend, "read_file", read_file)
        reading = asyncio.create_task(tier.get(meta.key, memoryview(bytearray(meta.size))))
        await _until(read_done)
        await tier.put(meta, data)
        stored.set()
        with pytest.raises(IntegrityError):
            await reading
        monkeypatch.undo()
        assert chunk_files(tmp_path) == [path]
        assert list((tmp_path / "quarantine").iterdir()) == []
        assert await tier.contains(meta.key) and tier.used == fmt.file_bytes(meta.size)
        out = bytearray(meta.size)
        await tier.get(meta.key, memoryview(out))
        assert out == data
        assert tier.stats.integrity_errors == 1 and tier.stats.extra["quarantined"] == 0

    run(tmp_path, body)


def test_put_racing_close_is_a_tier_error_and_leaves_no_file(tmp_path: Path) -> None:
    """Under ``batch`` a put whose write finishes while the tier closes finds the group sync
    closed: it fails like any tier I/O failure (TierIOError) and its unsynced file is removed."""

    async def body(tier: NvmeTier) -> None:
        meta, data = chunk(1, 20_000)
        putting = asyncio.create_task(tier.put(meta, data))
        await asyncio.sleep(0)  # the write is on the pool; close() waits for it
        await tier.close()
        with pytest.raises(TierIOError):
            await putting
        assert chunk_files(tmp_path) == [] and not await tier.contains(meta.key)

    run(tmp_path, body, fsync="batch")


def test_group_sync_submit_after_close_is_a_tier_io_error(tmp_path: Path) -> None:
    group = GroupSync(str(tmp_path / SYNC_MARKER), per_file=True)
    group.close()
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    with pytest.raises(TierIOError, match="closed"):
        group.submit(fd)
    with pytest.raises(OSError):
        os.fstat(fd)  # closed by submit, as promised


class _FakeCuFile:
    """Just enough of ``kvikio.CuFile`` (plain file I/O) to run KvikioBackend without CUDA."""

    def __init__(self, path: str, mode: str) -> None:
        self._f = open(path, "r+b" if mode == "r" else "w+b")  # noqa: SIM115

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


def test_kvikio_backend_read_names_the_file_it_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kvikio backend reports the identity of the file it read (what quarantine checks)."""
    from kvstrata.tiers._nvme_io import KvikioBackend

    monkeypatch.setitem(sys.modules, "kvikio", type(sys)("kvikio"))
    monkeypatch.setattr(sys.modules["kvikio"], "CuFile", _FakeCuFile, raising=False)
    meta, data = chunk(1, 10_000)
    header = fmt.encode_header(meta, meta.checksum, 0)
    path = str(tmp_path / "c.kvc")
    os.close(KvikioBackend().write_file(path, header, memoryview(data)))
    out = bytearray(meta.size)
    head, got, ident = KvikioBackend().read_file(path, memoryview(out))
    st = os.stat(path)
    assert (head, got, bytes(out), ident) == (header, meta.size, data, (st.st_dev, st.st_ino))
