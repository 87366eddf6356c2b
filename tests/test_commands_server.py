"""Server commands called directly: INFO CONFIG COMMAND TIME MONITOR SHUTDOWN."""

from __future__ import annotations

import time

import pytest

import kvstrata
from kvstrata.protocol.frames import NO_REPLY, OK, Simple
from kvstrata.server.commands.server import human_bytes
from tests.fakectx import FakeCtx, FakeServer, FakeStore, err


@pytest.fixture
def srv() -> FakeServer:
    return FakeServer()


@pytest.fixture
def c(srv: FakeServer) -> FakeCtx:
    return srv.connect()


def parse_info(text: bytes) -> dict[str, dict[str, str]]:
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] = {}
    for line in text.decode().split("\r\n"):
        if line.startswith("# "):
            current = sections.setdefault(line[2:], {})
        elif line:
            key, _, value = line.partition(":")
            current[key] = value
    return sections


def test_info_default_sections(srv: FakeServer, c: FakeCtx) -> None:
    srv.store = FakeStore()
    c.call("SET", "a", "1")
    c.call("SET", "b", "1", "EX", "100")
    raw = c.call("INFO")
    assert (
        isinstance(raw, bytes) and raw.endswith(b"\r\n") and b"\n" not in raw.replace(b"\r\n", b"")
    )
    info = parse_info(raw)
    assert {"Server", "Clients", "Memory", "Stats", "Keyspace", "Tiers", "Persistence"} <= set(info)
    server = info["Server"]
    assert server["redis_version"] == "7.2.0"
    assert server["kvstrata_version"] == kvstrata.__version__
    assert server["redis_mode"] == "standalone" and server["run_id"] == "ab" * 20
    assert server["tcp_port"] == "7379" and int(server["uptime_in_days"]) == 1
    assert {"os", "arch_bits", "process_id", "executable", "config_file"} <= set(server)
    assert info["Clients"]["connected_clients"] == "1"
    assert info["Clients"]["blocked_clients"] == "0"
    assert info["Memory"]["used_memory"] == str(3 * 1024 * 1024)
    assert info["Memory"]["used_memory_human"] == "3.00M"
    assert info["Memory"]["maxmemory"] == str(srv.config.get("dram-capacity"))
    assert info["Keyspace"]["db0"] == "keys=2,expires=1,avg_ttl=0"
    assert info["Tiers"]["dram"] == "capacity=64,used=0"
    assert info["Persistence"]["loading"] == "0"


def test_info_selected_sections(srv: FakeServer, c: FakeCtx) -> None:
    only = parse_info(c.call("INFO", "SERVER", "stats"))
    assert set(only) == {"Server", "Stats"}
    assert parse_info(c.call("INFO", "all"))["Keyspace"] == {}  # empty: header, no db0 line
    assert parse_info(c.call("INFO", "keyspace")) == {"Keyspace": {}}
    assert c.call("INFO", "nosuchsection") == b""
    assert "Server" in parse_info(c.call("INFO", "everything"))


def test_info_stats_and_resetstat(srv: FakeServer, c: FakeCtx) -> None:
    c.call("GET", "missing")
    c.call("SET", "k", "v")
    c.call("GET", "k")
    srv.stats.total_commands_processed = 7
    stats = parse_info(c.call("INFO", "stats"))["Stats"]
    assert stats["keyspace_hits"] == "1" and stats["keyspace_misses"] == "1"
    assert stats["total_commands_processed"] == "7"
    for field in ("total_connections_received", "total_net_input_bytes",
                  "total_net_output_bytes", "rejected_connections", "expired_keys",
                  "total_error_replies"):  # fmt: skip
        assert field in stats
    assert c.call("CONFIG", "RESETSTAT") == OK
    stats = parse_info(c.call("INFO", "stats"))["Stats"]
    assert stats["keyspace_hits"] == "0" and stats["total_commands_processed"] == "0"


def test_human_bytes() -> None:
    assert human_bytes(1023) == "1023B"
    assert human_bytes(1536) == "1.50K"
    assert human_bytes(1024**3) == "1.00G"


def test_config_get(c: FakeCtx) -> None:
    got = c.call("CONFIG", "GET", "slowlog-*")
    assert got == {"slowlog-log-slower-than": "10000", "slowlog-max-len": "128"}
    both = c.call("CONFIG", "GET", "port", "MAXCLIENTS", "port")
    assert both == {"port": "7379", "maxclients": "10000"}
    assert c.call("CONFIG", "GET", "nosuch") == {}
    assert c.call("CONFIG", "GET", "dram-capacity") == {"dram-capacity": "1GiB"}


def test_config_get_secret_only_by_exact_name() -> None:
    srv = FakeServer(requirepass="pw")
    c = srv.connect()
    c.call("AUTH", "pw")
    assert "requirepass" not in c.call("CONFIG", "GET", "*")
    assert len(c.call("CONFIG", "GET", "*")) > 20
    assert c.call("CONFIG", "GET", "requirepass") == {"requirepass": "pw"}


def test_config_set(srv: FakeServer, c: FakeCtx) -> None:
    assert c.call("CONFIG", "SET", "slowlog-max-len", "5", "TIMEOUT", "30") == OK
    assert srv.config.get("slowlog-max-len") == 5 and srv.config.get("timeout") == 30
    assert c.call("CONFIG", "GET", "timeout") == {"timeout": "30"}
    assert err(c, "CONFIG", "SET", "nosuch", "1") == (
        "ERR Unknown option or number of arguments for CONFIG SET - 'nosuch'"
    )
    assert err(c, "CONFIG", "SET", "port", "1") == (
        "ERR CONFIG SET failed (possibly related to argument 'port') - can't set immutable config"
    )
    assert err(c, "CONFIG", "SET", "maxclients", "x").startswith(
        "ERR CONFIG SET failed (possibly related to argument 'maxclients') - invalid value"
    )
    assert err(c, "CONFIG", "SET", "timeout", "1", "maxclients") == (
        "ERR wrong number of arguments for 'config|set' command"
    )
    assert err(c, "CONFIG", "SET", "timeout", "1", "timeout", "2").endswith("duplicate parameter")


def test_config_set_is_all_or_nothing(srv: FakeServer, c: FakeCtx) -> None:
    error = err(c, "CONFIG", "SET", "timeout", "99", "dram-low-watermark", "0.99")
    assert "dram-low-watermark" in error  # low above high: rejected by the cross-check
    assert srv.config.get("timeout") == 0
    assert srv.config.get("dram-low-watermark") == 0.85


def test_config_set_redacts_secrets(srv: FakeServer, c: FakeCtx) -> None:
    args = [b"CONFIG", b"SET", b"requirepass", b"topsecret"]
    spec = c.resolve(args)
    assert spec.handler is not None and spec.handler(c, args) == OK
    assert srv.config.get("requirepass") == "topsecret"
    assert b"topsecret" not in args


def test_command_introspection(srv: FakeServer, c: FakeCtx) -> None:
    count = c.call("COMMAND", "COUNT")
    assert count == len(srv.registry) and count >= 25
    assert len(c.call("COMMAND")) == count
    get, missing, client_id = c.call("COMMAND", "INFO", "get", "nosuch", "client|id")
    assert missing is None
    assert get[0] == "get" and get[1] == 2 and {b"readonly", b"fast"} <= get[2]
    assert all(isinstance(flag, Simple) for flag in get[2])  # status strings, as Redis
    assert get[3:6] == [1, 1, 1]
    assert client_id[0] == "client|id"
    client = c.call("COMMAND", "INFO", "CLIENT")[0]
    assert "client|setinfo" in {sub[0] for sub in client[9]}
    hello = c.call("COMMAND", "INFO", "hello")[0]
    assert b"no_auth" in hello[2]


def test_command_docs_and_list(c: FakeCtx) -> None:
    docs = c.call("COMMAND", "DOCS", "set", "nosuch", "client")
    assert set(docs) == {"set", "client"}
    assert docs["set"]["group"] == "string" and docs["set"]["arguments"][0]["name"] == "key"
    condition = docs["set"]["arguments"][2]
    assert condition["flags"] == {Simple(b"optional")}  # redis-cli asserts status strings
    assert "setinfo" in {k.split("|")[-1] for k in docs["client"]["subcommands"]}
    everything = c.call("COMMAND", "DOCS")
    assert {"ping", "scan", "config", "slowlog"} <= set(everything)
    names = c.call("COMMAND", "LIST")
    assert "get" in names and "config|get" in names
    assert sorted(c.call("COMMAND", "LIST", "FILTERBY", "PATTERN", "slowlog*")) == [
        "slowlog", "slowlog|get", "slowlog|help", "slowlog|len", "slowlog|reset",
    ]  # fmt: skip
    assert "get" in c.call("COMMAND", "LIST", "FILTERBY", "ACLCAT", "@string")
    assert c.call("COMMAND", "LIST", "FILTERBY", "MODULE", "x") == []
    assert err(c, "COMMAND", "LIST", "FILTERBY") == "ERR syntax error"


def test_every_command_is_documented(srv: FakeServer) -> None:
    for spec in srv.registry:
        for s in [spec, *spec.subcommands.values()]:
            assert s.summary and s.arity != 0, s.name
            if s.handler is not None and s.arity not in (1, 2, -1) and "|" not in s.name:
                assert s.arguments, f"{s.name} has no argument docs"


def test_time(c: FakeCtx) -> None:
    sec, usec = c.call("TIME")
    assert abs(int(sec) - time.time()) < 60 and 0 <= int(usec) < 1_000_000


def test_monitor_and_shutdown(srv: FakeServer, c: FakeCtx) -> None:
    assert c.call("MONITOR") == OK
    assert c in srv.monitors and "O" in c.client.flags
    other = srv.connect()
    assert err(other, "SHUTDOWN", "ABORT") == "ERR No shutdown in progress."
    assert err(other, "SHUTDOWN", "SAVE", "NOSAVE") == "ERR syntax error"
    assert err(other, "SHUTDOWN", "BOGUS") == "ERR syntax error"
    assert not srv.shutdown_requested
    assert other.call("SHUTDOWN", "NOSAVE", "NOW") is NO_REPLY
    assert srv.shutdown_requested and other.closing_after_reply


def test_help_replies(c: FakeCtx) -> None:
    for container in ("CONFIG", "COMMAND", "SLOWLOG"):
        lines = c.call(container, "HELP")
        assert lines[0].startswith(container.encode()) and lines[-1] == b"    Print this help."
    assert err(c, "CONFIG", "REWRITE") == "ERR unknown subcommand 'REWRITE'. Try CONFIG HELP."
