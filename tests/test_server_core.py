"""The network core against real sockets: pipelining, large payloads, malformed input, limits,
flow control, security, TLS and shutdown. Servers run on port 0 on loopback."""

from __future__ import annotations

import asyncio
import random
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC
from pathlib import Path

import pytest
import redis

from kvstrata.protocol.frames import OK
from kvstrata.server.admission import DENIED
from kvstrata.server.connection import Connection
from kvstrata.server.registry import REGISTRY, command
from tests.conftest import RunningServer, free_port, raw_exchange


@pytest.fixture
def slow_command() -> Iterator[None]:
    """A test-only async command: TEST.SLEEP ms → the ms, after sleeping."""

    @command("TEST.SLEEP", 2, "", group="test", summary="test only")
    async def sleep(ctx: object, args: list[bytes]) -> int:
        ms = int(args[1])
        await asyncio.sleep(ms / 1000)
        return ms

    yield
    REGISTRY.remove("TEST.SLEEP")


def read_until(sock: socket.socket, marker: bytes, timeout: float = 5.0) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while marker not in data:
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        data += chunk
    return data


def test_inline_and_multibulk_mixed(server: RunningServer) -> None:
    reply = raw_exchange(
        server.port, b"PING\r\n*2\r\n$4\r\nECHO\r\n$2\r\nhi\r\nECHO 'a b'\n", until=b"$3\r\na b\r\n"
    )
    assert reply == b"+PONG\r\n$2\r\nhi\r\n$3\r\na b\r\n"


def test_async_command_keeps_pipeline_order(server: RunningServer, slow_command: None) -> None:
    """Scenario: an async command in the middle of a pipeline; later replies wait for it."""
    wire = b"PING\r\nTEST.SLEEP 50\r\nECHO x\r\nTEST.SLEEP 1\r\nPING\r\n"
    reply = raw_exchange(server.port, wire, until=b"+PONG\r\n:50\r\n$1\r\nx\r\n:1\r\n+PONG\r\n")
    assert reply == b"+PONG\r\n:50\r\n$1\r\nx\r\n:1\r\n+PONG\r\n"


@pytest.mark.parametrize("size", [0, 1, 65535, 65536, 300_000, 5 * 1024 * 1024])
def test_values_of_every_size_round_trip(server: RunningServer, size: int) -> None:
    r = redis.Redis(port=server.port, protocol=3)
    value = random.Random(size).randbytes(size)
    assert r.set("k", value) is True
    assert r.get("k") == value
    r.close()


def test_large_payload_split_in_odd_pieces(server: RunningServer) -> None:
    """Scenario: a 1 MiB SET arrives in ragged pieces, with a PING glued behind it."""
    value = bytes(range(256)) * 4096
    wire = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\n%b\r\nPING\r\n" % (len(value), value)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        rnd = random.Random(7)
        pos = 0
        while pos < len(wire):
            step = rnd.choice([1, 2, 3, 1000, 70_000])
            sock.sendall(wire[pos : pos + step])
            pos += step
        assert read_until(sock, b"+PONG\r\n") == b"+OK\r\n+PONG\r\n"
    assert redis.Redis(port=server.port).get("k") == value


@pytest.mark.parametrize(
    "garbage",
    [
        b"*1\r\n+PING\r\n",
        b"*-5x\r\n",
        b"*1\r\n$-7\r\n",
        b"*1\r\n$9999999999999999999999\r\n",
        b"*1\r\n$4\r\nPINGxx",
        b'SET k "unbalanced\r\n',
    ],
)
def test_malformed_input_closes_only_that_connection(server: RunningServer, garbage: bytes) -> None:
    other = redis.Redis(port=server.port)
    assert other.ping()
    reply = raw_exchange(server.port, garbage, expect_close=True)
    assert reply.startswith(b"-ERR Protocol error: ") and reply.endswith(b"\r\n")
    assert other.ping()
    assert other.set("still", "here") and other.get("still") == b"here"


def test_binary_garbage_line_is_an_unknown_inline_command(server: RunningServer) -> None:
    """As in Redis, a line that is not a multibulk frame is an inline command."""
    reply = raw_exchange(server.port, b"\x00\xff\xfe*garbage\r\nPING\r\n", until=b"+PONG")
    assert reply.startswith(b"-ERR unknown command '") and reply.endswith(b"\r\n+PONG\r\n")


def test_commands_before_garbage_are_answered(server: RunningServer) -> None:
    reply = raw_exchange(server.port, b"PING\r\n*1\r\n$4\r\nPING\r\n*x\r\n", expect_close=True)
    assert reply == b"+PONG\r\n+PONG\r\n-ERR Protocol error: invalid multibulk length\r\n"


def test_limits_on_bulk_length_and_argument_count(make_server) -> None:
    srv = make_server(proto_max_bulk_len="1MiB", max_multibulk_len=8)
    big = raw_exchange(srv.port, b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$2000000\r\n", expect_close=True)
    assert big == b"-ERR Protocol error: invalid bulk length\r\n"
    many = raw_exchange(srv.port, b"*9\r\n", expect_close=True)
    assert many == b"-ERR Protocol error: invalid multibulk length\r\n"
    assert redis.Redis(port=srv.port).ping()


def test_query_buffer_limit(make_server) -> None:
    srv = make_server(client_query_buffer_limit="1MiB")
    # a command of a million small args, 400k of them sent: more than the 1 MiB limit
    wire = b"*1000000\r\n" + b"$1\r\nx\r\n" * 400_000
    before = srv.server.stats.protocol_errors
    try:
        reply = raw_exchange(srv.port, wire, expect_close=True)
    except (ConnectionResetError, BrokenPipeError):
        reply = b""  # closed with our unread bytes still queued: the kernel may send a reset
    assert reply in (b"", b"-ERR Protocol error: client query buffer limit reached\r\n")
    assert srv.server.stats.protocol_errors == before + 1
    assert redis.Redis(port=srv.port).ping()


def test_seeded_fuzz_leaves_server_serving(server: RunningServer) -> None:
    """Scenario: 10k mutated frames over 50 connections; the server keeps answering."""
    rnd = random.Random(20261130)
    seeds = [
        b"*1\r\n$4\r\nPING\r\n",
        b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n",
        b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n",
        b"PING\r\n",
        b"*2\r\n$4\r\nECHO\r\n$3\r\nabc\r\n",
    ]
    frames = 0
    for _ in range(50):
        payload = bytearray()
        for _ in range(200):
            frame = bytearray(rnd.choice(seeds))
            for _ in range(rnd.randint(0, 3)):
                op = rnd.randrange(3)
                i = rnd.randrange(len(frame))
                if op == 0:
                    frame[i] = rnd.randrange(256)
                elif op == 1:
                    del frame[i]
                else:
                    frame.insert(i, rnd.randrange(256))
            payload += frame
            frames += 1
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            try:
                sock.sendall(bytes(payload))
                sock.shutdown(socket.SHUT_WR)
                sock.settimeout(0.5)
                while sock.recv(65536):
                    pass
            except (ConnectionError, TimeoutError):
                pass
    assert frames == 10_000
    r = redis.Redis(port=server.port)
    assert r.ping() and r.echo("alive") == b"alive"


def test_client_that_never_reads_is_bounded(server: RunningServer) -> None:
    """Scenario: a client pipelines GETs of a 1 MiB value and never reads. The server stops
    reading from it (its buffered replies stay bounded) and keeps serving others."""
    r = redis.Redis(port=server.port)
    r.set("big", b"x" * (1 << 20))
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    request = b"*2\r\n$3\r\nGET\r\n$3\r\nbig\r\n" * 2000  # 2 GB of replies if all executed
    sock.setblocking(False)
    sent = 0
    deadline = time.monotonic() + 3
    while sent < len(request) and time.monotonic() < deadline:
        try:
            sent += sock.send(request[sent:])
        except BlockingIOError:
            time.sleep(0.01)
    time.sleep(0.3)

    def buffered() -> int:
        conns = [c for c in server.server.clients.values() if c.transport is not None]
        return max(c.transport.get_write_buffer_size() for c in conns)

    assert buffered() < 16 * (1 << 20)
    assert r.ping() and r.get("big") == b"x" * (1 << 20)
    sock.close()


def test_maxclients(make_server) -> None:
    srv = make_server(maxclients=2)
    a = socket.create_connection(("127.0.0.1", srv.port))
    b = socket.create_connection(("127.0.0.1", srv.port))
    a.sendall(b"PING\r\n")
    b.sendall(b"PING\r\n")
    assert read_until(a, b"\r\n") == b"+PONG\r\n" and read_until(b, b"\r\n") == b"+PONG\r\n"
    with socket.create_connection(("127.0.0.1", srv.port)) as third:
        assert read_until(third, b"\r\n") == b"-ERR max number of clients reached\r\n"
    a.close()
    b.close()


def test_auth_required(make_server) -> None:
    srv = make_server(requirepass="s3cret")
    reply = raw_exchange(
        srv.port, b"GET k\r\nAUTH wrong\r\nAUTH s3cret\r\nGET k\r\n", until=b"$-1\r\n"
    )
    assert reply == (
        b"-NOAUTH Authentication required.\r\n"
        b"-WRONGPASS invalid username-password pair or user is disabled.\r\n"
        b"+OK\r\n$-1\r\n"
    )
    r = redis.Redis(port=srv.port, password="s3cret", protocol=3)
    assert r.ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=srv.port, password="nope", protocol=3).ping()


class _FakeTransport:
    def __init__(self, peer: tuple[str, int]) -> None:
        self.peer = peer
        self.written = b""
        self.closed = False

    def get_extra_info(self, name: str) -> object:
        return {"peername": self.peer, "sockname": ("0.0.0.0", 7379)}.get(name)

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass


@pytest.mark.parametrize(
    ("peer", "password", "denied"),
    [
        (("10.1.2.3", 5000), "", True),
        (("127.0.0.1", 5000), "", False),
        (("::1", 5000, 0, 0), "", False),
        (("10.1.2.3", 5000), "pw", False),
    ],
)
def test_protected_mode(server: RunningServer, peer, password: str, denied: bool) -> None:
    """A remote peer (no network traffic: a transport that reports a remote address) is refused
    with Redis's DENIED text when no password is set; loopback peers and passwords pass."""

    def check() -> tuple[bytes, bool]:
        server.server.config.values["requirepass"] = password
        conn = Connection(server.server)
        transport = _FakeTransport(peer)
        conn.connection_made(transport)  # type: ignore[arg-type]
        server.server.clients.pop(conn.client.id, None)
        server.server.config.values["requirepass"] = ""
        return transport.written, transport.closed

    written, closed = server.call(check)
    assert (written == DENIED and closed) if denied else (written == b"" and not closed)


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    from datetime import datetime, timedelta

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now - timedelta(days=1))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def test_tls(make_server, tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    srv = make_server(tls_port=free_port(), tls_cert_file=cert, tls_key_file=key)
    tls_port = srv.server.tls_port
    r = redis.Redis(port=tls_port, ssl=True, ssl_ca_certs=str(cert), protocol=3)
    value = b"v" * 200_000
    assert r.set("secure", value) and r.get("secure") == value
    ctx = ssl.create_default_context(cafile=str(cert))
    with (
        socket.create_connection(("127.0.0.1", tls_port)) as raw,
        ctx.wrap_socket(raw, server_hostname="localhost") as sock,
    ):
        sock.sendall(b"PING\r\n")
        assert sock.recv(100) == b"+PONG\r\n"


def test_bad_config_stops_startup_with_message(tmp_path: Path) -> None:
    for flag, value, words in [
        ("--port", "abc", "'port'"),
        ("--dram-capacity", "4XB", "not a size"),
        ("--nvme-write-policy", "sometimes", "write-back"),
    ]:
        proc = subprocess.run(
            [sys.executable, "-m", "kvstrata", "serve", flag, value, "--data-dir", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2
        assert "configuration error" in proc.stderr and words in proc.stderr
        assert "Traceback" not in proc.stderr


def test_sigterm_graceful_shutdown(make_process_server) -> None:
    srv = make_process_server()
    r = redis.Redis(port=srv.port)
    assert r.set("a", "1")
    assert srv.process is not None
    srv.process.send_signal(signal.SIGTERM)
    assert srv.process.wait(30) == 0


def test_shutdown_command_lets_inflight_finish(make_server, slow_command: None) -> None:
    """Scenario: client A runs a 300 ms command; client B sends SHUTDOWN meanwhile. A still
    gets its reply before the server closes."""
    srv = make_server()
    a = socket.create_connection(("127.0.0.1", srv.port))
    a.sendall(b"TEST.SLEEP 300\r\n")
    time.sleep(0.05)
    b = socket.create_connection(("127.0.0.1", srv.port))
    b.sendall(b"SHUTDOWN\r\n")
    assert read_until(a, b"\r\n") == b":300\r\n"
    assert srv.thread is not None
    srv.thread.join(10)
    assert not srv.thread.is_alive()
    a.close()
    b.close()


def test_redis_benchmark_runs_unchanged(server: RunningServer) -> None:
    proc = subprocess.run(
        [
            "redis-benchmark",
            "-p",
            str(server.port),
            "-t",
            "ping,set,get",
            "-n",
            "2000",
            "-c",
            "4",
            "-P",
            "8",
            "-q",
            "--csv",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    tests = {line.split(",")[0].strip('"') for line in proc.stdout.splitlines()[1:]}
    assert {"PING_INLINE", "PING_MBULK", "SET", "GET"} <= tests
    assert OK  # frames import used by handlers in this module


def test_shutdown_in_a_pipeline_answers_what_came_before(make_server) -> None:
    srv = make_server()
    reply = raw_exchange(srv.port, b"PING\r\nSHUTDOWN\r\nPING\r\n", expect_close=True)
    assert reply == b"+PONG\r\n"
    assert srv.thread is not None
    srv.thread.join(10)
    assert not srv.thread.is_alive()


def test_unauthenticated_clients_get_only_small_frames(make_server) -> None:
    """Before AUTH, a header may not make the server allocate: frames are limited as in
    Redis 7 (10 arguments, 16 KiB bulks); after AUTH the configured limits apply."""
    srv = make_server(requirepass="pw")
    big = raw_exchange(srv.port, b"*2\r\n$4\r\nECHO\r\n$536870912\r\n", expect_close=True)
    assert big == b"-ERR Protocol error: invalid bulk length\r\n"
    many = raw_exchange(srv.port, b"*11\r\n", expect_close=True)
    assert many == b"-ERR Protocol error: invalid multibulk length\r\n"
    value = b"v" * 100_000
    wire = b"AUTH pw\r\n*2\r\n$4\r\nECHO\r\n$100000\r\n" + value + b"\r\n"
    reply = raw_exchange(srv.port, wire, until=value + b"\r\n")
    assert reply == b"+OK\r\n$100000\r\n" + value + b"\r\n"


def test_non_ascii_garbage_is_a_protocol_error_after_earlier_commands(server) -> None:
    reply = raw_exchange(server.port, b"SET k v\r\n*1\r\n\xff", expect_close=True)
    assert reply == b"+OK\r\n-ERR Protocol error: expected '$', got '\\xff'\r\n"
    assert redis.Redis(port=server.port).get("k") == b"v"


def test_huge_command_name_is_an_unknown_command(server) -> None:
    name = b"x" * 70_000
    reply = raw_exchange(server.port, b"*1\r\n$70000\r\n" + name + b"\r\nPING\r\n", until=b"PONG")
    assert reply.startswith(b"-ERR unknown command 'xxx") and reply.endswith(b"+PONG\r\n")
