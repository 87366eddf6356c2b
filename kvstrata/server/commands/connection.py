"""Connection commands: PING ECHO HELLO AUTH SELECT QUIT RESET and CLIENT.

Semantics and error wording follow Redis 7 so that redis-cli and redis-py work unchanged.
There is one user, ``default``, whose password is ``requirepass`` (none when empty); there is
one database, 0. This module also holds the small argument helpers the other standard command
modules share (:func:`parse_int`, :func:`arg_bytes`, :func:`help_reply`) and
:func:`unknown_subcommand` for the dispatcher.
"""

from __future__ import annotations

import hmac
import re
import time
from typing import Any

import kvstrata
from kvstrata.protocol.errors import (
    CommandError,
    NoAuthError,
    NoProtoError,
    WrongPassError,
    not_integer,
    syntax_error,
)
from kvstrata.protocol.frames import OK, PONG, Simple, Verbatim
from kvstrata.server.context import Ctx
from kvstrata.server.registry import Arg, Args, Reply, command, container

REDIS_COMPAT_VERSION = "7.2.0"
REDACTED = b"(redacted)"
_INT_RE = re.compile(rb"0|-?[1-9][0-9]{0,18}")
_INT64 = (-(2**63), 2**63 - 1)


# -- argument helpers shared by the standard command modules ------------------------------
def arg_bytes(arg: Any) -> bytes:
    """An argument as immutable bytes (keys, names, small values)."""
    return arg if type(arg) is bytes else bytes(arg)


def arg_upper(arg: Any) -> bytes:
    return arg_bytes(arg).upper()


def arg_text(arg: Any) -> str:
    return arg_bytes(arg).decode("utf-8", "replace")


def parse_int(arg: Any, error: CommandError | None = None) -> int:
    """A signed 64-bit integer written as Redis's ``string2ll`` accepts it."""
    data = arg_bytes(arg)
    if _INT_RE.fullmatch(data):
        value = int(data)
        if _INT64[0] <= value <= _INT64[1]:
            return value
    raise error if error is not None else not_integer()


def unknown_subcommand(container: str, sub: Any) -> CommandError:
    """``ERR unknown subcommand 'x'. Try CLIENT HELP.`` (used by the dispatcher)."""
    name = arg_text(sub)[:128]
    return CommandError(f"unknown subcommand '{name}'. Try {container.upper()} HELP.")


def help_reply(container: str, lines: list[str]) -> list[Simple]:
    """The reply of ``X HELP``: simple strings, as Redis's ``addReplyHelp``."""
    head = f"{container} <subcommand> [<arg> [value] [opt] ...]. Subcommands are:"
    tail = ["HELP", "    Print this help."]
    return [Simple(line.encode()) for line in [head, *lines, *tail]]


def _valid_name(name: bytes) -> bool:
    return all(0x21 <= b <= 0x7E for b in name)


# -- PING ECHO SELECT QUIT -------------------------------------------------------------------
@command(
    "PING",
    -1,
    "fast",
    group="connection",
    summary="Returns the server's liveliness response.",
    arguments=(Arg("message", "string", optional=True),),
    reply="Simple string PONG, or the message as a bulk string.",
)
def ping(ctx: Ctx, args: Args) -> Reply:
    if len(args) > 2:
        raise CommandError("wrong number of arguments for 'ping' command")
    return PONG if len(args) == 1 else arg_bytes(args[1])


@command(
    "ECHO",
    2,
    "fast",
    group="connection",
    summary="Returns the given string.",
    arguments=(Arg("message", "string"),),
    reply="Bulk string: the message.",
)
def echo(ctx: Ctx, args: Args) -> Reply:
    return arg_bytes(args[1])


@command(
    "SELECT",
    2,
    "loading stale fast",
    group="connection",
    summary="Changes the selected database (kvstrata has one database: 0).",
    arguments=(Arg("index", "integer"),),
    reply="Simple string OK.",
)
def select(ctx: Ctx, args: Args) -> Reply:
    if parse_int(args[1]) != 0:
        raise CommandError("DB index is out of range")
    return OK


@command(
    "QUIT",
    -1,
    "allow_busy noscript loading stale fast no_auth",
    group="connection",
    summary="Closes the connection.",
    reply="Simple string OK, then the server closes the connection.",
)
def quit_(ctx: Ctx, args: Args) -> Reply:
    ctx.close_after_reply()
    return OK


# -- AUTH HELLO RESET ------------------------------------------------------------------------
def authenticate(ctx: Ctx, user: bytes | None, password: bytes) -> None:
    """Check credentials of the single ``default`` user; mark the client authenticated."""
    required = str(ctx.server.config.get("requirepass"))
    if user is None and not required:
        raise CommandError(
            "AUTH <password> called without any password configured for the default user. "
            "Are you sure your configuration is correct?"
        )
    ok = user in (None, b"default") and (
        not required or hmac.compare_digest(password, required.encode())
    )
    if not ok:
        raise WrongPassError("invalid username-password pair or user is disabled.")
    ctx.client.authenticated = True
    ctx.client.user = "default"


def is_authenticated(ctx: Ctx) -> bool:
    return ctx.client.authenticated or not ctx.server.config.get("requirepass")


@command(
    "AUTH",
    -2,
    "noscript loading stale fast no_auth allow_busy",
    group="connection",
    summary="Authenticates the connection (user 'default', password = requirepass).",
    arguments=(
        Arg("username", "string", optional=True),
        Arg("password", "string"),
    ),
    reply="Simple string OK, or WRONGPASS.",
)
def auth(ctx: Ctx, args: Args) -> Reply:
    if len(args) > 3:
        raise syntax_error()
    user = arg_bytes(args[1]) if len(args) == 3 else None
    password = arg_bytes(args[-1])
    for i in range(1, len(args)):
        args[i] = REDACTED  # keeps the password out of the slow log and MONITOR
    authenticate(ctx, user, password)
    return OK


def _parse_hello(args: Args) -> tuple[int | None, tuple[bytes, bytes] | None, bytes | None]:
    version: int | None = None
    creds: tuple[bytes, bytes] | None = None
    name: bytes | None = None
    i = 1
    if len(args) >= 2:
        version = parse_int(
            args[1], CommandError("Protocol version is not an integer or out of range")
        )
        if version not in (2, 3):
            raise NoProtoError("unsupported protocol version")
        i = 2
    while i < len(args):
        opt, more = arg_upper(args[i]), len(args) - 1 - i
        if opt == b"AUTH" and more >= 2:
            creds = (arg_bytes(args[i + 1]), arg_bytes(args[i + 2]))
            args[i + 1] = args[i + 2] = REDACTED
            i += 3
        elif opt == b"SETNAME" and more >= 1:
            name = arg_bytes(args[i + 1])
            if not _valid_name(name):
                raise CommandError(
                    "Client names cannot contain spaces, newlines or special characters."
                )
            i += 2
        else:
            raise CommandError(f"Syntax error in HELLO option '{arg_text(args[i])}'")
    return version, creds, name


@command(
    "HELLO",
    -1,
    "noscript loading stale fast no_auth allow_busy",
    group="connection",
    summary="Handshakes with the server: protocol version, authentication, client name.",
    arguments=(
        Arg(
            "arguments",
            "block",
            optional=True,
            arguments=(
                Arg("protover", "integer"),
                Arg(
                    "username-password",
                    "block",
                    optional=True,
                    token="AUTH",
                    arguments=(Arg("username", "string"), Arg("password", "string")),
                ),
                Arg("clientname", "string", optional=True, token="SETNAME"),
            ),
        ),
    ),
    reply="Map: server, version (Redis compatibility level), kvstrata, proto, id, mode, "
    "role, modules.",
)
def hello(ctx: Ctx, args: Args) -> Reply:
    version, creds, name = _parse_hello(args)
    if creds is not None:
        authenticate(ctx, *creds)
    if not is_authenticated(ctx):
        raise NoAuthError(
            "HELLO must be called with the client already authenticated, otherwise the "
            "HELLO <proto> AUTH <user> <pass> option can be used to authenticate the client "
            "and select the RESP protocol version at the same time"
        )
    if name is not None:
        ctx.client.name = name
    if version is not None:
        ctx.set_protocol(version)
        ctx.client.protocol = version
    return {
        "server": "redis",
        "version": REDIS_COMPAT_VERSION,
        "kvstrata": kvstrata.__version__,
        "proto": ctx.client.protocol,
        "id": ctx.client.id,
        "mode": "standalone",
        "role": "master",
        "modules": [],
    }


@command(
    "RESET",
    1,
    "noscript loading stale fast no_auth allow_busy",
    group="connection",
    summary="Resets the connection: RESP2, no name, MONITOR off, unauthenticated if a "
    "password is set.",
    reply="Simple string RESET.",
)
def reset(ctx: Ctx, args: Args) -> Reply:
    client = ctx.client
    ctx.stop_monitor()
    client.flags.difference_update({"O", "e", "T"})
    client.name = b""
    client.db = 0
    client.user = "default"
    client.authenticated = not ctx.server.config.get("requirepass")
    ctx.set_protocol(2)
    client.protocol = 2
    return Simple(b"RESET")


# -- CLIENT ------------------------------------------------------------------------------------
container("CLIENT", group="connection", summary="A container for client connection commands.")
_CLIENT_FLAGS = "noscript loading stale"
_CLIENT_TYPES = {b"normal", b"master", b"slave", b"replica", b"pubsub"}


@command(
    "CLIENT|ID",
    2,
    _CLIENT_FLAGS,
    group="connection",
    summary="Returns the unique client ID of the connection.",
    reply="Integer: the id.",
)
def client_id(ctx: Ctx, args: Args) -> Reply:
    return ctx.client.id


@command(
    "CLIENT|SETNAME",
    3,
    _CLIENT_FLAGS,
    group="connection",
    summary="Sets the connection name (empty removes it).",
    arguments=(Arg("connection-name", "string"),),
    reply="Simple string OK.",
)
def client_setname(ctx: Ctx, args: Args) -> Reply:
    name = arg_bytes(args[2])
    if not _valid_name(name):
        raise CommandError("Client names cannot contain spaces, newlines or special characters.")
    ctx.client.name = name
    return OK


@command(
    "CLIENT|GETNAME",
    2,
    _CLIENT_FLAGS,
    group="connection",
    summary="Returns the name of the connection.",
    reply="Bulk string: the name, or null when none is set.",
)
def client_getname(ctx: Ctx, args: Args) -> Reply:
    return ctx.client.name or None


@command(
    "CLIENT|SETINFO",
    4,
    _CLIENT_FLAGS,
    group="connection",
    summary="Sets information about the client library (LIB-NAME, LIB-VER).",
    arguments=(
        Arg(
            "attr",
            "oneof",
            arguments=(
                Arg("libname", "string", token="LIB-NAME"),
                Arg("libver", "string", token="LIB-VER"),
            ),
        ),
    ),
    reply="Simple string OK.",
)
def client_setinfo(ctx: Ctx, args: Args) -> Reply:
    attr, value = arg_upper(args[2]), arg_bytes(args[3])
    if attr not in (b"LIB-NAME", b"LIB-VER"):
        raise CommandError(f"Unrecognized option '{arg_text(args[2])}'")
    if not _valid_name(value):
        raise CommandError(
            f"{arg_text(args[2])} cannot contain spaces, newlines or special characters."
        )
    if attr == b"LIB-NAME":
        ctx.client.lib_name = value
    else:
        ctx.client.lib_ver = value
    return OK


def _on_off(ctx: Ctx, args: Args, flag: str) -> Reply:
    mode = arg_upper(args[2])
    if mode == b"ON":
        ctx.client.flags.add(flag)
    elif mode == b"OFF":
        ctx.client.flags.discard(flag)
    else:
        raise syntax_error()
    return OK


_ON_OFF = (
    Arg(
        "enabled",
        "oneof",
        arguments=(Arg("on", "pure-token", token="ON"), Arg("off", "pure-token", token="OFF")),
    ),
)


@command(
    "CLIENT|NO-EVICT",
    3,
    _CLIENT_FLAGS,
    group="connection",
    summary="Sets the client eviction mode (accepted for compatibility; flag only).",
    arguments=_ON_OFF,
    reply="Simple string OK.",
)
def client_no_evict(ctx: Ctx, args: Args) -> Reply:
    return _on_off(ctx, args, "e")


@command(
    "CLIENT|NO-TOUCH",
    3,
    _CLIENT_FLAGS,
    group="connection",
    summary="Controls whether commands sent by the client alter the LRU (flag only).",
    arguments=_ON_OFF,
    reply="Simple string OK.",
)
def client_no_touch(ctx: Ctx, args: Args) -> Reply:
    return _on_off(ctx, args, "T")


@command(
    "CLIENT|INFO",
    2,
    _CLIENT_FLAGS,
    group="connection",
    summary="Returns information about the connection.",
    reply="Verbatim string: one CLIENT LIST line.",
)
def client_info(ctx: Ctx, args: Args) -> Reply:
    return Verbatim((ctx.client.describe() + "\n").encode())


@command(
    "CLIENT|LIST",
    -2,
    "admin " + _CLIENT_FLAGS,
    group="connection",
    summary="Lists open connections.",
    complexity="O(N) where N is the number of client connections",
    arguments=(
        Arg("client-type", "string", token="TYPE"),
        Arg("client-id", "integer", optional=True, multiple=True, token="ID"),
    ),
    reply="Verbatim string: one line per connection.",
)
def client_list(ctx: Ctx, args: Args) -> Reply:
    ids: set[int] | None = None
    if len(args) == 4 and arg_upper(args[2]) == b"TYPE":
        kind = arg_bytes(args[3]).lower()
        if kind not in _CLIENT_TYPES:
            raise CommandError(f"Unknown client type '{arg_text(args[3])}'")
        if kind != b"normal":
            return Verbatim(b"")
    elif len(args) > 3 and arg_upper(args[2]) == b"ID":
        ids = {_client_id_arg(a, "Invalid client ID") for a in args[3:]}
    elif len(args) != 2:
        raise syntax_error()
    now = time.monotonic()
    lines = [
        conn.client.describe(now) + "\n"
        for conn in list(ctx.server.clients.values())
        if ids is None or conn.client.id in ids
    ]
    return Verbatim("".join(lines).encode())


def _client_id_arg(arg: Any, message: str) -> int:
    value = parse_int(arg, CommandError(message))
    if value < 1:
        raise CommandError(message)
    return value


def _kill_filters(args: Args) -> dict[str, Any]:
    """Parse the new form ``CLIENT KILL <filter> <value> ...``."""
    filters: dict[str, Any] = {"skipme": True}
    i = 2
    while i < len(args):
        opt = arg_upper(args[i])
        if i + 1 >= len(args):
            raise syntax_error()
        value = args[i + 1]
        if opt == b"ID":
            filters["id"] = _client_id_arg(value, "client-id should be greater than 0")
        elif opt == b"TYPE":
            kind = arg_bytes(value).lower()
            if kind not in _CLIENT_TYPES:
                raise CommandError(f"Unknown client type '{arg_text(value)}'")
            filters["type"] = kind
        elif opt in (b"ADDR", b"LADDR"):
            filters[opt.decode().lower()] = arg_text(value)
        elif opt == b"USER":
            if arg_bytes(value) != b"default":
                raise CommandError(f"No such user '{arg_text(value)}'")
        elif opt == b"SKIPME":
            answer = arg_upper(value)
            if answer not in (b"YES", b"NO"):
                raise syntax_error()
            filters["skipme"] = answer == b"YES"
        else:
            raise syntax_error()
        i += 2
    return filters


def _kill_matching(ctx: Ctx, filters: dict[str, Any]) -> int:
    killed = 0
    for conn in list(ctx.server.clients.values()):
        state = conn.client
        if "id" in filters and state.id != filters["id"]:
            continue
        if filters.get("type", b"normal") != b"normal":
            continue
        if "addr" in filters and state.addr != filters["addr"]:
            continue
        if "laddr" in filters and state.laddr != filters["laddr"]:
            continue
        if state is ctx.client:
            if filters["skipme"]:
                continue
            ctx.close_after_reply()
        else:
            conn.kill()
        killed += 1
    return killed


@command(
    "CLIENT|KILL",
    -3,
    "admin " + _CLIENT_FLAGS,
    group="connection",
    summary="Terminates open connections: `CLIENT KILL ip:port`, or filters ID, ADDR, LADDR, "
    "TYPE, USER, SKIPME.",
    complexity="O(N) where N is the number of client connections",
    arguments=(
        Arg(
            "filter",
            "oneof",
            arguments=(
                Arg("ip:port", "string"),
                Arg(
                    "new-format",
                    "oneof",
                    multiple=True,
                    arguments=(
                        Arg("client-id", "integer", token="ID"),
                        Arg("client-type", "string", token="TYPE"),
                        Arg("username", "string", token="USER"),
                        Arg("ip:port", "string", token="ADDR"),
                        Arg("ip:port", "string", token="LADDR"),
                        Arg("yes/no", "string", token="SKIPME"),
                    ),
                ),
            ),
        ),
    ),
    reply="Old form: simple string OK. New form: integer, the number of clients killed.",
)
def client_kill(ctx: Ctx, args: Args) -> Reply:
    if len(args) == 3:
        if _kill_matching(ctx, {"addr": arg_text(args[2]), "skipme": False}) == 0:
            raise CommandError("No such client")
        return OK
    return _kill_matching(ctx, _kill_filters(args))


@command(
    "CLIENT|HELP",
    2,
    "loading stale",
    group="connection",
    summary="Returns helpful text about the different subcommands.",
    reply="Array of simple strings.",
)
def client_help(ctx: Ctx, args: Args) -> Reply:
    return help_reply(
        "CLIENT",
        [
            "GETNAME",
            "    Return the name of the current connection.",
            "ID",
            "    Return the ID of the current connection.",
            "INFO",
            "    Return information about the current client connection.",
            "KILL <ip:port>",
            "    Kill connection made from <ip:port>.",
            "KILL <option> <value> [<option> <value> [...]]",
            "    Kill connections. Options are: ID <client-id>, TYPE normal, USER default,",
            "    ADDR <ip:port>, LADDR <ip:port>, SKIPME (YES|NO).",
            "LIST [options ...]",
            "    Return information about client connections. Options: TYPE normal,",
            "    ID <client-id> [<client-id> ...].",
            "NO-EVICT (ON|OFF)",
            "    Protect current client connection from eviction (flag only).",
            "NO-TOUCH (ON|OFF)",
            "    Will not touch LRU/LFU stats when this mode is on (flag only).",
            "SETINFO <option> <value>",
            "    Set client meta attr. Options are: LIB-NAME, LIB-VER.",
            "SETNAME <name>",
            "    Assign the name <name> to the current connection.",
        ],
    )
