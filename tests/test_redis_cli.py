"""End-to-end: the standard commands through the real ``redis-cli`` (Redis 7)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable

import pytest

from tests.conftest import RunningServer

pytestmark = pytest.mark.skipif(shutil.which("redis-cli") is None, reason="needs redis-cli")


def cli(
    srv: RunningServer, *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["redis-cli", "-h", srv.host, "-p", str(srv.port), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=30,
    )


def out(srv: RunningServer, *args: str) -> str:
    done = cli(srv, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_ping_echo_and_resp3(server: RunningServer) -> None:
    assert out(server, "PING") == "PONG\n"
    assert out(server, "ECHO", "hi there") == "hi there\n"
    assert out(server, "-3", "PING") == "PONG\n"
    hello = out(server, "-3", "HELLO", "3")
    assert "version\n7.2.0" in hello.replace(" ", "\n") and "proto\n3" in hello.replace(" ", "\n")
    assert out(server, "-3", "CONFIG", "GET", "slowlog-max-len").split() == [
        "slowlog-max-len",
        "128",
    ]


def test_set_get_and_types(server: RunningServer) -> None:
    assert out(server, "SET", "k", "v", "EX", "100") == "OK\n"
    assert out(server, "GET", "k") == "v\n"
    assert out(server, "TYPE", "k") == "string\n"
    assert out(server, "TYPE", "missing") == "none\n"
    ttl = int(out(server, "TTL", "k"))
    assert 99 <= ttl <= 100
    assert "ERR syntax error" in out(server, "SET", "k", "v", "NX", "XX")


def test_info(server: RunningServer) -> None:
    out(server, "SET", "a", "1")
    text = out(server, "INFO")
    assert "# Server" in text and "redis_version:7.2.0" in text
    assert "kvstrata_version:" in text and "db0:keys=1,expires=0,avg_ttl=0" in text
    assert out(server, "INFO", "keyspace").splitlines() == [
        "# Keyspace",
        "db0:keys=1,expires=0,avg_ttl=0",
    ]


def test_scan_pattern(server: RunningServer) -> None:
    batch = "".join(f"SET user:{i} x\n" for i in range(300)) + "SET other 1\n"
    assert cli(server, stdin=batch).returncode == 0
    keys = out(server, "--scan", "--pattern", "user:*").split()
    assert sorted(keys) == sorted(f"user:{i}" for i in range(300))
    assert out(server, "DBSIZE") == "301\n"


def test_command_docs_in_both_protocols(server: RunningServer) -> None:
    assert out(server, "COMMAND", "DOCS", "get").startswith("get\nsummary\n")
    docs3 = out(server, "-3", "COMMAND", "DOCS", "set")
    assert docs3.startswith("set") and "KEEPTTL" in docs3
    assert int(out(server, "COMMAND", "COUNT")) >= 25


def test_piped_batch(server: RunningServer) -> None:
    """redis-cli reading commands from stdin first loads COMMAND DOCS for its hints."""
    done = cli(server, stdin="PING\nSET x 1\nINCRBYNOPE x\nGET x\nCLIENT SETNAME batch\n")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line]  # an error adds a blank line
    assert lines[0:2] == ["PONG", "OK"]
    assert lines[2].startswith("ERR unknown command 'INCRBYNOPE'")
    assert lines[3:] == ["1", "OK"]


def test_client_list_and_kill(server: RunningServer) -> None:
    listing = out(server, "CLIENT", "LIST")
    assert listing.startswith("id=") and "cmd=client|list" in listing
    assert out(server, "CLIENT", "KILL", "127.0.0.1:1").strip() == "ERR No such client"
    assert out(server, "CLIENT", "KILL", "ID", "999999") == "0\n"


def test_slowlog_through_cli(server: RunningServer) -> None:
    out(server, "CONFIG", "SET", "slowlog-log-slower-than", "0")
    out(server, "SET", "logged", "1")
    text = out(server, "SLOWLOG", "GET", "-1")
    assert "logged" in text
    assert int(out(server, "SLOWLOG", "LEN")) >= 1
    assert out(server, "SLOWLOG", "RESET") == "OK\n"


def test_auth_flows(make_server: Callable[..., RunningServer]) -> None:
    srv = make_server(requirepass="pw")
    assert "NOAUTH Authentication required." in out(srv, "PING")
    assert out(srv, "-a", "pw", "--no-auth-warning", "PING") == "PONG\n"
    assert out(srv, "--user", "default", "--pass", "pw", "--no-auth-warning", "PING") == "PONG\n"
    assert out(srv, "-3", "-a", "pw", "--no-auth-warning", "PING") == "PONG\n"
    bad = cli(srv, "-a", "nope", "--no-auth-warning", "PING")
    assert (
        "WRONGPASS invalid username-password pair or user is disabled." in bad.stdout + bad.stderr
    )
    assert "PONG" not in bad.stdout
    batch = cli(srv, "--no-auth-warning", stdin="AUTH pw\nPING\n")
    assert batch.stdout.splitlines() == ["OK", "PONG"]


def test_shutdown_through_cli(make_server: Callable[..., RunningServer]) -> None:
    srv = make_server()
    done = cli(srv, "SHUTDOWN", "NOSAVE")
    assert done.stdout == ""  # no reply: the server closes the connection
    assert srv.thread is not None
    srv.thread.join(15)
    assert not srv.thread.is_alive()


def test_strlen_and_subcommand_arity_wording(server) -> None:
    import redis as redis_py

    r = redis_py.Redis(port=server.port)
    r.set("s", "hello")
    assert r.strlen("s") == 5 and r.strlen("missing") == 0
    with pytest.raises(redis_py.ResponseError, match=r"'client\|setname'"):
        r.execute_command("CLIENT", "SETNAME")
