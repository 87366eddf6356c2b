"""Connection commands called directly: PING ECHO SELECT QUIT AUTH HELLO RESET CLIENT."""

from __future__ import annotations

import pytest

import kvstrata
from kvstrata.protocol.frames import OK, Simple, Verbatim
from kvstrata.server.commands._args import parse_int, unknown_subcommand
from tests.fakectx import FakeServer, err

WRONGPASS = "WRONGPASS invalid username-password pair or user is disabled."


@pytest.fixture
def srv() -> FakeServer:
    return FakeServer()


def test_ping_echo_select(srv: FakeServer) -> None:
    c = srv.connect()
    assert c.call("PING") == Simple(b"PONG")
    assert isinstance(c.call("PING"), Simple)
    assert c.call("PING", "hi") == b"hi" and not isinstance(c.call("PING", "hi"), Simple)
    assert c.call("ECHO", b"\x00x") == b"\x00x"
    assert c.call("SELECT", "0") == OK
    assert err(c, "SELECT", "1") == "ERR DB index is out of range"
    assert err(c, "SELECT", "x") == "ERR value is not an integer or out of range"
    assert err(c, "ECHO") == "ERR wrong number of arguments for 'echo' command"


def test_quit_closes_after_reply(srv: FakeServer) -> None:
    c = srv.connect()
    assert c.call("QUIT") == OK
    assert c.closing_after_reply


@pytest.mark.parametrize(
    ("text", "value"),
    [
        (b"0", 0),
        (b"-12", -12),
        (b"9223372036854775807", 2**63 - 1),
        (b"-9223372036854775808", -(2**63)),
    ],
)
def test_parse_int_accepts(text: bytes, value: int) -> None:
    assert parse_int(text) == value


@pytest.mark.parametrize(
    "text", [b"", b"+1", b" 1", b"1 ", b"01", b"-0", b"1.0", b"9223372036854775808", b"1_0"]
)
def test_parse_int_rejects_like_redis(text: bytes) -> None:
    with pytest.raises(Exception, match="not an integer"):
        parse_int(text)


def test_unknown_subcommand_wording() -> None:
    assert unknown_subcommand("client", b"x").reply_line() == (
        b"ERR unknown subcommand 'x'. Try CLIENT HELP."
    )
    srv = FakeServer()
    assert err(srv.connect(), "CLIENT", "nope") == "ERR unknown subcommand 'nope'. Try CLIENT HELP."


def test_auth_without_password_configured(srv: FakeServer) -> None:
    c = srv.connect()
    assert err(c, "AUTH", "pw") == (
        "ERR AUTH <password> called without any password configured for the default user. "
        "Are you sure your configuration is correct?"
    )
    assert c.call("AUTH", "default", "anything") == OK  # default user has no password
    assert err(c, "AUTH", "other", "x") == WRONGPASS
    assert err(c, "AUTH", "a", "b", "c") == "ERR syntax error"


def test_auth_with_requirepass() -> None:
    srv = FakeServer(requirepass="s3cret")
    c = srv.connect()
    assert not c.client.authenticated
    assert err(c, "PING") == "NOAUTH Authentication required."
    assert err(c, "AUTH", "wrong") == WRONGPASS
    assert not c.client.authenticated
    assert err(c, "AUTH", "root", "s3cret") == WRONGPASS
    assert c.call("AUTH", "s3cret") == OK
    assert c.client.authenticated
    assert c.call("PING") == Simple(b"PONG")
    c2 = srv.connect()
    assert c2.call("AUTH", "default", "s3cret") == OK


def test_auth_redacts_arguments_for_the_slow_log() -> None:
    srv = FakeServer(requirepass="s3cret")
    c = srv.connect()
    args = [b"AUTH", b"default", b"s3cret"]
    spec = srv.registry.lookup(b"auth")
    assert spec is not None and spec.handler is not None
    assert spec.handler(c, args) == OK
    assert b"s3cret" not in args


def test_hello_switches_protocol_and_reports(srv: FakeServer) -> None:
    c = srv.connect()
    reply = c.call("HELLO", "3")
    assert c.client.protocol == 3
    assert reply["server"] == "redis" and reply["version"] == "7.2.0"
    assert reply["kvstrata"] == kvstrata.__version__
    assert reply["proto"] == 3 and reply["id"] == c.client.id
    assert reply["mode"] == "standalone" and reply["role"] == "master"
    assert reply["modules"] == []
    assert c.call("HELLO")["proto"] == 3  # without a version: the current protocol
    assert c.call("HELLO", "2", "SETNAME", "me")["proto"] == 2
    assert c.client.protocol == 2 and c.client.name == b"me"


def test_hello_errors(srv: FakeServer) -> None:
    c = srv.connect()
    assert err(c, "HELLO", "4") == "NOPROTO unsupported protocol version"
    assert err(c, "HELLO", "1") == "NOPROTO unsupported protocol version"
    assert err(c, "HELLO", "x") == "ERR Protocol version is not an integer or out of range"
    assert err(c, "HELLO", "3", "BOGUS") == "ERR Syntax error in HELLO option 'BOGUS'"
    assert err(c, "HELLO", "3", "AUTH", "u") == "ERR Syntax error in HELLO option 'AUTH'"
    assert c.client.protocol == 2


def test_hello_auth() -> None:
    srv = FakeServer(requirepass="pw")
    c = srv.connect()
    assert err(c, "HELLO", "3").startswith("NOAUTH HELLO must be called with the client")
    assert c.client.protocol == 2
    assert err(c, "HELLO", "3", "AUTH", "default", "bad") == WRONGPASS
    assert c.call("HELLO", "3", "AUTH", "default", "pw", "SETNAME", "n")["proto"] == 3
    assert c.client.authenticated and c.client.name == b"n"


def test_reset() -> None:
    srv = FakeServer(requirepass="pw")
    c = srv.connect()
    c.call("HELLO", "3", "AUTH", "default", "pw", "SETNAME", "n")
    c.call("CLIENT", "NO-EVICT", "on")
    c.start_monitor()
    assert c.call("RESET") == Simple(b"RESET")
    assert c.client.protocol == 2 and c.client.name == b""
    assert not c.client.authenticated
    assert c not in srv.monitors and "O" not in c.client.flags and "e" not in c.client.flags
    plain = FakeServer().connect()
    plain.call("RESET")
    assert plain.client.authenticated  # no password: stays usable


def test_client_id_name_info(srv: FakeServer) -> None:
    c = srv.connect()
    assert c.call("CLIENT", "ID") == c.client.id
    assert c.call("CLIENT", "GETNAME") is None
    assert c.call("CLIENT", "SETNAME", "worker-1") == OK
    assert c.call("CLIENT", "GETNAME") == b"worker-1"
    assert err(c, "CLIENT", "SETNAME", "a b") == (
        "ERR Client names cannot contain spaces, newlines or special characters."
    )
    info = c.call("CLIENT", "INFO")
    assert isinstance(info, Verbatim)
    assert info.data.startswith(f"id={c.client.id} ".encode()) and info.data.endswith(b"\n")
    assert b" name=worker-1 " in info.data
    assert c.call("CLIENT", "SETNAME", "") == OK
    assert c.call("CLIENT", "GETNAME") is None


def test_client_setinfo_and_flags(srv: FakeServer) -> None:
    c = srv.connect()
    assert c.call("CLIENT", "SETINFO", "LIB-NAME", "redis-py") == OK
    assert c.call("CLIENT", "SETINFO", "lib-ver", "8.1.0") == OK
    assert c.client.lib_name == b"redis-py" and c.client.lib_ver == b"8.1.0"
    assert err(c, "CLIENT", "SETINFO", "foo", "x") == "ERR Unrecognized option 'foo'"
    assert err(c, "CLIENT", "SETINFO", "LIB-NAME", "a b").endswith(
        "cannot contain spaces, newlines or special characters."
    )
    assert c.call("CLIENT", "NO-TOUCH", "on") == OK and "T" in c.client.flags
    assert c.call("CLIENT", "NO-TOUCH", "OFF") == OK and "T" not in c.client.flags
    assert err(c, "CLIENT", "NO-EVICT", "maybe") == "ERR syntax error"


def test_client_list_filters(srv: FakeServer) -> None:
    a, b = srv.connect(), srv.connect()
    text = a.call("CLIENT", "LIST").data.decode()
    lines = text.splitlines()
    assert len(lines) == 2 and text.endswith("\n")
    assert {line.split()[0] for line in lines} == {f"id={a.client.id}", f"id={b.client.id}"}
    only_b = a.call("CLIENT", "LIST", "ID", str(b.client.id)).data.decode()
    assert only_b.startswith(f"id={b.client.id} ") and only_b.count("\n") == 1
    assert a.call("CLIENT", "LIST", "TYPE", "normal").data.count(b"\n") == 2
    assert a.call("CLIENT", "LIST", "TYPE", "pubsub").data == b""
    assert err(a, "CLIENT", "LIST", "TYPE", "bogus") == "ERR Unknown client type 'bogus'"
    assert err(a, "CLIENT", "LIST", "ID", "0") == "ERR Invalid client ID"
    assert err(a, "CLIENT", "LIST", "FOO") == "ERR syntax error"


def test_client_kill_old_form(srv: FakeServer) -> None:
    a = srv.connect()
    b = srv.connect(addr="127.0.0.1:55555")
    assert a.call("CLIENT", "KILL", "127.0.0.1:55555") == OK
    assert b.killed and not a.killed
    assert err(a, "CLIENT", "KILL", "127.0.0.1:1") == "ERR No such client"
    assert a.call("CLIENT", "KILL", a.client.addr) == OK  # old form may kill itself
    assert a.closing_after_reply and not a.killed


def test_client_kill_new_form(srv: FakeServer) -> None:
    a, b, c = srv.connect(), srv.connect(), srv.connect()
    assert a.call("CLIENT", "KILL", "ID", str(b.client.id)) == 1
    assert b.killed and not c.killed
    assert a.call("CLIENT", "KILL", "ID", str(a.client.id)) == 0  # SKIPME yes by default
    assert a.call("CLIENT", "KILL", "LADDR", "127.0.0.1:7379") == 1  # everyone but a
    assert c.killed and not a.killed
    assert a.call("CLIENT", "KILL", "ID", str(a.client.id), "SKIPME", "no") == 1
    assert a.closing_after_reply
    assert err(a, "CLIENT", "KILL", "ID", "0") == "ERR client-id should be greater than 0"
    assert err(a, "CLIENT", "KILL", "ID", "1", "SKIPME") == "ERR syntax error"
    assert err(a, "CLIENT", "KILL", "FOO", "1") == "ERR syntax error"
    assert err(a, "CLIENT", "KILL", "USER", "bob") == "ERR No such user 'bob'"


def test_client_help(srv: FakeServer) -> None:
    lines = srv.connect().call("CLIENT", "HELP")
    assert all(isinstance(line, Simple) for line in lines)
    assert lines[0].startswith(b"CLIENT <subcommand>")
    assert any(line.startswith(b"KILL") for line in lines)
