"""A real S3 endpoint for tests: moto's server mode as a subprocess on a free loopback port.

Use it as a pytest plugin (``pytest_plugins = ["tests.s3fixture"]``) or import
:class:`MotoServer` directly. Fixtures:

- ``moto_server``: one server for the whole session (dummy AWS credentials are put in the
  environment of the test process while it runs); ``s3_endpoint`` is its URL.
- ``s3_bucket``: a fresh, empty bucket per test on the session server.
- ``private_moto_server``: a server of the test's own, for outage tests: ``stop()`` it,
  ``freeze()`` it (SIGSTOP: connections hang instead of being refused), ``restart()`` it on the
  same port. moto keeps everything in memory, so a restart starts with no buckets.

Loopback only; nothing here reaches the internet.
"""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

DUMMY_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
_CLEARED_ENV = ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _command(port: int) -> list[str]:
    exe = shutil.which("moto_server")
    base = [exe] if exe else [sys.executable, "-m", "moto.server"]
    return [*base, "-H", "127.0.0.1", "-p", str(port)]


class MotoServer:
    """One moto_server process; survives stop/restart on the same port."""

    def __init__(self, port: int | None = None, start_timeout: float = 30.0) -> None:
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.frozen = False

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        if self.running:
            return
        env = {**os.environ, **DUMMY_ENV}
        self.proc = subprocess.Popen(
            _command(self.port),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.proc.returncode}")
            try:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=1.0)
                conn.request("GET", "/")
                conn.getresponse().read()
                conn.close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"moto_server did not answer on {self.endpoint} in time")

    def stop(self) -> None:
        """Terminate the process; clients then get connection refused."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if self.frozen:
            proc.send_signal(signal.SIGCONT)
            self.frozen = False
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def restart(self) -> None:
        """Stop (if running) and start again on the same port, with empty state."""
        self.stop()
        self.start()

    def freeze(self) -> None:
        """SIGSTOP the server: connections are accepted by the kernel but never answered."""
        if self.proc is not None and not self.frozen:
            self.proc.send_signal(signal.SIGSTOP)
            self.frozen = True

    def thaw(self) -> None:
        if self.proc is not None and self.frozen:
            self.proc.send_signal(signal.SIGCONT)
            self.frozen = False

    def client(self) -> Any:
        """A plain boto3 S3 client for this server (for setup and tampering in tests)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=DUMMY_ENV["AWS_DEFAULT_REGION"],
            aws_access_key_id=DUMMY_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=DUMMY_ENV["AWS_SECRET_ACCESS_KEY"],
            config=Config(retries={"max_attempts": 1, "mode": "standard"}),
        )

    def make_bucket(self, name: str | None = None) -> str:
        name = name or f"kvs-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        return name

    def __enter__(self) -> MotoServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="session")
def aws_test_env() -> Iterator[dict[str, str]]:
    """Dummy credentials in os.environ for the session (restored afterwards)."""
    saved = {k: os.environ.get(k) for k in (*DUMMY_ENV, *_CLEARED_ENV)}
    for k in _CLEARED_ENV:
        os.environ.pop(k, None)
    os.environ.update(DUMMY_ENV)
    try:
        yield dict(DUMMY_ENV)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def moto_server(aws_test_env: dict[str, str]) -> Iterator[MotoServer]:
    with MotoServer() as server:
        yield server


@pytest.fixture(scope="session")
def s3_endpoint(moto_server: MotoServer) -> str:
    return moto_server.endpoint


@pytest.fixture
def s3_bucket(moto_server: MotoServer) -> str:
    return moto_server.make_bucket()


@pytest.fixture
def private_moto_server(aws_test_env: dict[str, str]) -> Iterator[MotoServer]:
    with MotoServer() as server:
        yield server
