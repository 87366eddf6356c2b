"""One server per data folder: a second ``kvstrata serve`` on a data-dir (or an nvme-path) that
a live server holds exits at once with one line naming the folder and the holder's pid; the
first keeps serving its bytes; once the holder is gone (SIGKILL included) a new server starts
on the same folder and serves what was written."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from kvstrata.config import load_config
from kvstrata.datadir import LOCK_NAME, FolderInUse
from kvstrata.server.app import Server
from tests.conftest import TEST_DEFAULTS, RunningServer

NS = "lock@bf16@c16"
PAYLOAD = bytes(range(256)) * 256  # 64 KiB


def serve_once(data_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """``kvstrata serve`` expected to stop at start-up (a timeout here: it started)."""
    argv = [sys.executable, "-m", "kvstrata", "serve", "--port", "0", "--data-dir",
            str(data_dir), "--dram-capacity", "8MiB", *extra]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=30)


def listen(data_dir: Path, **flags: str) -> None:
    """Start-up up to binding the port, in this process (a second server here); shut down."""
    values = {**TEST_DEFAULTS, "data-dir": str(data_dir), **flags}
    server = Server(load_config(flags=values, env={}))

    async def main() -> None:
        await server.listen()
        await server.shutdown()

    asyncio.run(main())


def in_use(what: str, folder: Path, pid: int) -> str:
    return (
        f"{what} {folder.resolve()} is in use by another kvstrata server (pid {pid}); stop it "
        f"or give this one another {what}"
    )


def test_second_server_on_a_data_dir_exits_and_a_new_one_starts_after_kill_9(
    make_process_server: Callable[..., RunningServer], tmp_path: Path
) -> None:
    data = tmp_path / "data"
    first = make_process_server(data_dir=data, nvme_write_policy="write-through")
    assert first.process is not None
    r = redis.Redis(port=first.port, socket_timeout=10)
    assert r.execute_command("KV.PUT", NS, b"c0", b"", PAYLOAD) == 1

    second = serve_once(data)
    assert second.returncode == 1 and "Traceback" not in second.stderr
    assert second.stderr.strip().splitlines() == [
        "kvstrata: cannot start: " + in_use("data-dir", data, first.process.pid)
    ]
    assert "ready on" not in second.stdout + second.stderr
    assert r.execute_command("KV.GET", NS, b"c0") == PAYLOAD  # the holder is untouched
    r.close()

    os.kill(first.process.pid, signal.SIGKILL)
    first.process.wait(30)
    again = make_process_server(data_dir=data, nvme_write_policy="write-through")
    assert again.process is not None
    r = redis.Redis(port=again.port, socket_timeout=10)
    assert r.execute_command("KV.GET", NS, b"c0") == PAYLOAD
    assert (data / LOCK_NAME).read_text() == f"{again.process.pid}\n"
    r.close()


def test_shared_nvme_path_is_locked_too(
    make_server: Callable[..., RunningServer], tmp_path: Path
) -> None:
    """Two data folders, one nvme-path: the NVMe slabs would be shared, so the second
    server is refused (in this process too: flock is per open file); after the first
    stops, it starts."""
    nvme = tmp_path / "shared-nvme"
    first = make_server(data_dir=tmp_path / "a", nvme_path=nvme)
    with pytest.raises(FolderInUse) as err:
        listen(tmp_path / "b", **{"nvme-path": str(nvme)})
    assert str(err.value) == in_use("nvme-path", nvme, os.getpid())
    with pytest.raises(FolderInUse, match=r"data-dir .* is in use"):
        listen(tmp_path / "a")
    first.stop()
    again = make_server(data_dir=tmp_path / "b", nvme_path=nvme)
    assert redis.Redis(port=again.port).ping()


def test_lock_file_in_the_nvme_folder_is_not_quarantined(
    make_server: Callable[..., RunningServer], tmp_path: Path
) -> None:
    """nvme-path = data-dir: the tier's start-up scan quarantines foreign files in its folder,
    but never the lock a server holds there."""
    data = tmp_path / "both"
    for _ in range(2):  # the second start scans a folder that already holds the lock file
        srv = make_server(data_dir=data, nvme_path=data)
        assert (data / LOCK_NAME).read_text() == f"{os.getpid()}\n"
        assert not (data / "quarantine" / LOCK_NAME).exists()
        assert not list((data / "quarantine").iterdir())
        srv.stop()
        assert (data / LOCK_NAME).read_text() == ""  # released: no holder's pid left behind


@pytest.mark.parametrize("below", [False, True], ids=["the-file", "under-the-file"])
def test_a_data_dir_that_is_a_file_is_named_as_a_file(tmp_path: Path, below: bool) -> None:
    blocker = tmp_path / "afile"
    blocker.write_text("not a folder")
    data_dir = blocker / "sub" if below else blocker
    proc = subprocess.run(
        [sys.executable, "-m", "kvstrata", "serve", "--port", "0", "--data-dir", str(data_dir)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    if below:
        expected = f"cannot create data-dir {data_dir}: {blocker} is a file, not a folder"
    else:
        expected = f"data-dir {blocker} is a file, not a folder"
    assert f"kvstrata: cannot start: {expected}" in proc.stderr
    assert "File exists" not in proc.stderr and "Traceback" not in proc.stderr
    assert blocker.read_text() == "not a folder"
