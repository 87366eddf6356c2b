"""A client kept open across server restarts never reads the previous server's arena (issue 10,
reproduction 1).

In a container the server is PID 1 after every restart, so an arena named after the PID was
created again under the same name, and a long-lived client resolved the new server's handles
through its mapping of the dead arena. Here the server runs as PID 1 of a fresh PID namespace
(``unshare --pid --fork --mount-proc``, root only), is stopped (SIGTERM, or SIGKILL) and started
again on the same port while one :class:`~kvstrata.clients.Client` stays open.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from kvstrata.clients import AsyncClient, Client
from kvstrata.clients import handles as client_handles
from tests.conftest import RunningServer, free_port

NS = "restart@u8@c16"
SIZE = 64 * 1024


def _unshare_works() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    if os.geteuid() != 0:
        return "needs root for a new PID namespace"
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=10
    )
    return None if probe.returncode == 0 else f"unshare failed: {probe.stderr!r}"


WHY = _unshare_works()


class Pid1Server:
    """``kvstrata serve`` as PID 1 of a new PID namespace, on a fixed port."""

    def __init__(self, port: int, data_dir: Path) -> None:
        argv = [
            "unshare", "--pid", "--fork", "--mount-proc",
            sys.executable, "-m", "kvstrata", "serve", "--port", str(port),
            "--data-dir", str(data_dir), "--dram-capacity", "8MiB", "--nvme-capacity", "0",
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert self.proc.stdout is not None
        lines = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if re.search(r"ready on .* port=\d+", line):
                break
        else:
            self.proc.kill()
        if not lines or "ready on" not in lines[-1]:
            self.proc.kill()
            raise RuntimeError("server did not start:\n" + "".join(lines))
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        self.host_pid = int(children.split()[0])  # the server, seen from our namespace

    def stop(self, sig: int) -> None:
        os.kill(self.host_pid, sig)
        self.proc.wait(30)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def _reconnect(kv: Client, limit: float = 10.0) -> None:
    """The pooled connection died with the old server: the first command may fail."""
    deadline = time.monotonic() + limit
    while True:
        try:
            kv.ping()
            return
        except (ConnectionError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.mark.skipif(WHY is not None, reason=WHY or "")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["graceful", "kill-9"])
def test_client_across_pid1_restarts_reads_the_new_arena(tmp_path: Path, sig: int) -> None:
    """Scenario: put A, lease A (kept), stop the PID-1 server (SIGTERM or kill -9), start it
    again as PID 1 on the same port, put B and lease B with the same Client: the view shows
    B's bytes. Both instances' regions carry different identities, the dead instance's
    mapping is dropped by the client, and the old view still shows A (kept alive by the
    view itself)."""
    port = free_port()
    first = Pid1Server(port, tmp_path / "data")
    old_path = ""
    try:
        assert redis.Redis(port=port).info("server")["process_id"] == 1
        kv = Client(port=port)
        assert kv.put(NS, b"A", None, b"A" * SIZE)
        lease_a = kv.lease(NS, [b"A"], ttl_ms=60_000)
        assert lease_a is not None
        view_a = lease_a.views()[0]
        assert bytes(view_a) == b"A" * SIZE
        [region_a] = kv.regions(refresh=False)
        old_path = region_a.path
        first.stop(sig)
        second = Pid1Server(port, tmp_path / "data")
        try:
            _reconnect(kv)
            assert redis.Redis(port=port).info("server")["process_id"] == 1
            assert kv.put(NS, b"B", None, b"B" * SIZE)
            lease_b = kv.lease(NS, [b"B"])
            assert lease_b is not None
            assert bytes(lease_b.views()[0]) == b"B" * SIZE, "read the previous server's arena"
            [region_b] = kv.regions(refresh=False)
            assert region_b.instance != region_a.instance and region_b.instance
            assert lease_b.handles[0].instance == region_b.instance
            mapped = {inst for inst, _ in client_handles._shm}
            assert region_a.instance not in mapped and region_b.instance in mapped
            assert bytes(view_a) == b"A" * SIZE  # the old mapping lives as long as its view
            lease_b.release()
            kv.close()
            # the dead instance's arena leaves /dev/shm (a killed server's, once it is stale)
            gone = Path("/dev/shm", old_path)
            deadline = time.monotonic() + 15
            while gone.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not gone.exists(), f"{gone} of the {sig!r}-stopped server is left behind"
        finally:
            second.stop(signal.SIGTERM)
    finally:
        if first.proc.poll() is None:
            first.stop(signal.SIGKILL)
        if old_path and sig == signal.SIGKILL:  # a killed server cannot unlink its arena
            Path("/dev/shm", old_path).unlink(missing_ok=True)


def test_async_client_across_a_restart_maps_the_new_instance(
    make_server: Callable[..., RunningServer], tmp_path: Path
) -> None:
    """The same with the asyncio client and an in-process server stopped and started again on
    the same port: the second lease reads the new arena, and the first instance's mapping is
    dropped from the client's table."""
    port = free_port()

    async def lease_bytes(kv: AsyncClient, h: bytes) -> tuple[bytes, str]:
        for _ in range(100):
            try:
                await kv.put(NS, h, None, h * SIZE)
                break
            except (ConnectionError, OSError):  # the pooled connection died with the server
                await asyncio.sleep(0.05)
        lease = await kv.lease(NS, [h])
        assert lease is not None
        try:
            return bytes(lease.views()[0]), lease.handles[0].instance
        finally:
            await lease.release()

    async def main() -> None:
        first = make_server(port=port, data_dir=tmp_path / "a", nvme_capacity="0")
        kv = await AsyncClient.connect(port=port)
        got, old = await lease_bytes(kv, b"A")
        assert got == b"A" * SIZE
        first.stop()
        make_server(port=port, data_dir=tmp_path / "b", nvme_capacity="0")
        got, new = await lease_bytes(kv, b"B")
        assert got == b"B" * SIZE and new != old
        assert old not in {inst for inst, _ in client_handles._shm}
        await kv.close()

    asyncio.run(main())
