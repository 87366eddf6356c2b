"""Standard commands on the wire: exact bytes from a real server on port 0."""

from __future__ import annotations

import re
import socket

from tests.conftest import RunningServer, raw_exchange


def test_ping_quit_bytes(server: RunningServer) -> None:
    assert raw_exchange(server.port, b"PING\r\nQUIT\r\n", expect_close=True) == b"+PONG\r\n+OK\r\n"


def test_quit_discards_the_rest_of_the_pipeline(server: RunningServer) -> None:
    reply = raw_exchange(server.port, b"QUIT\r\nPING\r\n", expect_close=True)
    assert reply == b"+OK\r\n"


def test_hello_reset_switch_protocols(server: RunningServer) -> None:
    reply = raw_exchange(server.port, b"HELLO 3\r\nRESET\r\nCLIENT INFO\r\n", until=b"lib-ver=")
    assert reply.startswith(
        b"%8\r\n$6\r\nserver\r\n$5\r\nredis\r\n$7\r\nversion\r\n$5\r\n7.2.0\r\n"
    )
    after_hello = reply[reply.index(b"+RESET\r\n") + 8 :]
    assert after_hello.startswith(b"$")  # back on RESP2: CLIENT INFO is a plain bulk string
    assert b" resp=2 " in after_hello


def test_resp3_shapes(server: RunningServer) -> None:
    reply = raw_exchange(
        server.port, b"HELLO 3\r\nCLIENT INFO\r\nCONFIG GET timeout\r\nTTL nope\r\n", until=b":-2"
    )
    assert b"\r\n=" in reply  # CLIENT INFO is a verbatim string in RESP3
    assert b"%1\r\n$7\r\ntimeout\r\n$1\r\n0\r\n" in reply  # CONFIG GET is a map
    assert reply.endswith(b":-2\r\n")


def test_errors_keep_the_connection(server: RunningServer) -> None:
    reply = raw_exchange(
        server.port,
        b"SELECT 1\r\nHELLO 4\r\nCLIENT FOO\r\nGET\r\nPING\r\n",
        until=b"+PONG\r\n",
    )
    assert reply == (
        b"-ERR DB index is out of range\r\n"
        b"-NOPROTO unsupported protocol version\r\n"
        b"-ERR unknown subcommand 'FOO'. Try CLIENT HELP.\r\n"
        b"-ERR wrong number of arguments for 'get' command\r\n"
        b"+PONG\r\n"
    )


def test_monitor_stream(server: RunningServer) -> None:
    with socket.create_connection((server.host, server.port), timeout=5) as mon:
        mon.sendall(b"MONITOR\r\n")
        assert mon.recv(100) == b"+OK\r\n"
        raw_exchange(server.port, b'SET "a b" "x\\ny"\r\n', until=b"+OK")
        data = b""
        while not data.endswith(b"\r\n"):
            data += mon.recv(1000)
    line_re = rb'\+\d{10}\.\d{6} \[0 127\.0\.0\.1:\d+\] "SET" "a b" "x\\ny"\r\n'
    assert re.fullmatch(line_re, data), data
