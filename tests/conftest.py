"""Fixtures: real kvstrata servers on port 0 (in a thread of this process, or a subprocess)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvstrata.config import load_config

TEST_DEFAULTS = {"dram-capacity": "64MiB", "nvme-capacity": "256MiB", "port": "0"}


@dataclass
class RunningServer:
    """A server started by a fixture: where to reach it and (in-thread) the Server object."""

    host: str
    port: int
    data_dir: Path
    server: Any = None  # kvstrata.server.app.Server when in-thread
    loop: asyncio.AbstractEventLoop | None = None
    thread: threading.Thread | None = None
    process: subprocess.Popen[str] | None = None

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the server's event loop and return its result."""
        assert self.loop is not None
        done = threading.Event()
        box: list[Any] = []

        def runner() -> None:
            try:
                box.append(fn())
            except BaseException as exc:
                box.append(exc)
            done.set()

        self.loop.call_soon_threadsafe(runner)
        done.wait(10)
        if box and isinstance(box[0], BaseException):
            raise box[0]
        return box[0] if box else None

    def stop(self) -> None:
        alive = self.thread is not None and self.thread.is_alive()
        if self.server is not None and self.loop is not None and alive:
            self.loop.call_soon_threadsafe(self.server.request_shutdown)
            assert self.thread is not None
            self.thread.join(15)
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_thread_server(data_dir: Path, **overrides: Any) -> RunningServer:
    """Start a server in a background thread with its own (uvloop) event loop."""
    import uvloop

    from kvstrata.server.app import Server

    flags = {**TEST_DEFAULTS, "data-dir": str(data_dir)}
    flags.update({k.replace("_", "-"): str(v) for k, v in overrides.items()})
    config = load_config(flags=flags, env={})
    loop = uvloop.new_event_loop()
    server = Server(config)
    started = threading.Event()
    errors: list[BaseException] = []

    def main() -> None:
        asyncio.set_event_loop(loop)

        async def run() -> None:
            task = asyncio.ensure_future(server.run())
            ready = asyncio.ensure_future(server.wait_ready())
            await asyncio.wait([task, ready], return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                task.result()  # a start-up error: in ``errors`` before ``started`` is set
            started.set()
            await task

        try:
            loop.run_until_complete(run())
        except BaseException as exc:
            errors.append(exc)
            started.set()
        finally:
            loop.close()

    thread = threading.Thread(target=main, name="kvstrata-test-server", daemon=True)
    thread.start()
    started.wait(30)
    if errors:
        raise errors[0]
    return RunningServer("127.0.0.1", server.port, data_dir, server, loop, thread)


def start_process_server(
    data_dir: Path, *extra: str, env: dict[str, str] | None = None, **overrides: Any
) -> RunningServer:
    """Start ``python -m kvstrata serve`` and read the port from its start-up line."""
    flags = {**TEST_DEFAULTS, "data-dir": str(data_dir)}
    flags.update({k.replace("_", "-"): str(v) for k, v in overrides.items()})
    argv = [sys.executable, "-m", "kvstrata", "serve"]
    for k, v in flags.items():
        argv += [f"--{k}", v]
    argv += list(extra)
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    deadline = time.monotonic() + 30
    assert proc.stdout is not None
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"ready on .* port=(\d+)", line)
        if m:
            threading.Thread(target=_drain, args=(proc,), daemon=True).start()
            return RunningServer("127.0.0.1", int(m.group(1)), data_dir, process=proc)
    proc.kill()
    raise RuntimeError("server did not start:\n" + "".join(lines))


def _drain(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    for _ in proc.stdout:
        pass


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[..., RunningServer]]:
    """Factory: ``make_server(requirepass="x", dram_capacity="8MiB")`` → RunningServer."""
    started: list[RunningServer] = []
    counter = iter(range(1000))

    def factory(**overrides: Any) -> RunningServer:
        data_dir = Path(overrides.pop("data_dir", tmp_path / f"data{next(counter)}"))
        srv = start_thread_server(data_dir, **overrides)
        started.append(srv)
        return srv

    yield factory
    for srv in started:
        srv.stop()


@pytest.fixture
def server(make_server: Callable[..., RunningServer]) -> RunningServer:
    """A kvstrata server with the test defaults (64 MiB DRAM, 256 MiB NVMe in tmp_path)."""
    return make_server()


@pytest.fixture
def make_process_server(tmp_path: Path) -> Iterator[Callable[..., RunningServer]]:
    """Factory for servers in a subprocess (for kill -9 / restart / signal tests)."""
    started: list[RunningServer] = []

    def factory(*extra: str, data_dir: Path | None = None, **overrides: Any) -> RunningServer:
        srv = start_process_server(data_dir or tmp_path / "pdata", *extra, **overrides)
        started.append(srv)
        return srv

    yield factory
    for srv in started:
        srv.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def redis_server_bin() -> str:
    path = shutil.which("redis-server")
    if path is None:
        pytest.fail("redis-server is not installed (apt-get install redis-server)")
    return path


def raw_exchange(
    port: int,
    data: bytes,
    expect_close: bool = False,
    timeout: float = 5.0,
    until: bytes | None = None,
) -> bytes:
    """Send raw bytes and read the reply (until ``until`` appears, or the peer closes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            chunks.append(chunk)
            if until is not None and until in b"".join(chunks) and not expect_close:
                break
        return b"".join(chunks)
