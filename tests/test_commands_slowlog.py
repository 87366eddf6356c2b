"""The slow log (record, trimming, live config) and the MONITOR line format."""

from __future__ import annotations

from kvstrata.protocol.frames import OK
from kvstrata.server.context import ClientState
from kvstrata.server.monitor import MAX_ARG_BYTES, format_monitor_line
from kvstrata.server.slowlog import trim_argv
from tests.fakectx import FakeServer, err


def client() -> ClientState:
    return ClientState(id=1, addr="127.0.0.1:5000", laddr="127.0.0.1:7379", name=b"app")


def test_record_threshold_and_live_config() -> None:
    srv = FakeServer()
    log = srv.slowlog
    log.record(9_999, [b"GET", b"k"], client())
    assert len(log) == 0
    log.record(10_000, [b"GET", b"k"], client())
    assert len(log) == 1
    c = srv.connect()
    c.call("CONFIG", "SET", "slowlog-log-slower-than", "-1")
    log.record(10**9, [b"GET", b"k"], client())
    assert len(log) == 1  # -1 disables
    c.call("CONFIG", "SET", "slowlog-log-slower-than", "0")
    log.record(0, [b"PING"], client())
    assert len(log) == 2


def test_slowlog_commands() -> None:
    srv = FakeServer(slowlog_log_slower_than="0", slowlog_max_len="3")
    c = srv.connect()
    for i in range(5):
        srv.slowlog.record(i, [b"SET", b"k%d" % i, b"v"], client())
    assert c.call("SLOWLOG", "LEN") == 3  # bounded by slowlog-max-len
    entries = c.call("SLOWLOG", "GET")
    assert [e[0] for e in entries] == [4, 3, 2]  # newest first, ids keep counting
    newest = entries[0]
    assert newest[2] == 4 and newest[3] == [b"SET", b"k4", b"v"]
    assert newest[4] == "127.0.0.1:5000" and newest[5] == b"app"
    assert isinstance(newest[1], int) and newest[1] > 1_600_000_000
    assert len(c.call("SLOWLOG", "GET", "1")) == 1
    assert len(c.call("SLOWLOG", "GET", "-1")) == 3
    assert c.call("SLOWLOG", "GET", "0") == []
    assert err(c, "SLOWLOG", "GET", "-2") == "ERR count should be greater than or equal to -1"
    assert err(c, "SLOWLOG", "GET", "x") == "ERR count should be greater than or equal to -1"
    assert c.call("SLOWLOG", "RESET") == OK
    assert c.call("SLOWLOG", "LEN") == 0


def test_argv_is_trimmed_as_redis_does() -> None:
    argv = [b"CMD", *[b"a%d" % i for i in range(40)]]
    kept = trim_argv(argv)
    assert len(kept) == 32
    assert kept[-1] == b"... (10 more arguments)"
    assert kept[30] == b"a29"
    payload = memoryview(bytearray(b"x" * 1_000_000))
    (cut,) = trim_argv([payload])
    assert cut == b"x" * 128 + b"... (999872 more bytes)"
    assert trim_argv([b"y" * 128]) == (b"y" * 128,)
    assert trim_argv([bytearray(b"ab")]) == (b"ab",)


def test_monitor_line_format() -> None:
    line = format_monitor_line(1700000000.123456, 0, "127.0.0.1:5000", [b"set", b"k", b"v"])
    assert line == b'1700000000.123456 [0 127.0.0.1:5000] "set" "k" "v"'
    tricky = format_monitor_line(1.0, 0, "a:1", [b'q"\\\n\r\t\x07\x08\x00\xff ok'])
    assert tricky == b'1.000000 [0 a:1] "q\\"\\\\\\n\\r\\t\\a\\b\\x00\\xff ok"'
    assert format_monitor_line(5.9999999, 0, "a:1", [b"x"]).startswith(b"6.000000 ")


def test_monitor_line_cuts_huge_payloads() -> None:
    payload = memoryview(bytearray(b"z" * (MAX_ARG_BYTES + 10)))
    line = format_monitor_line(1.0, 0, "a:1", [b"KV.PUT", payload])
    assert line.endswith(b'"... (10 more bytes)')
    assert len(line) < MAX_ARG_BYTES + 100
