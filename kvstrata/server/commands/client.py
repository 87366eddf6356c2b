"""CLIENT subcommands: ID SETNAME GETNAME SETINFO NO-EVICT NO-TOUCH INFO LIST KILL HELP.

Semantics and error wording follow Redis 7. Every connection is of type ``normal`` and user
``default``: filters on another type match nothing, on another user fail. NO-EVICT and
NO-TOUCH only set the flag CLIENT LIST shows. :func:`client_name` is also what HELLO's
SETNAME accepts.
"""

from __future__ import annotations

import time
from typing import Any

from kvstrata.protocol.errors import CommandError, syntax_error
from kvstrata.protocol.frames import OK, Verbatim
from kvstrata.server.commands._args import (
    arg_bytes,
    arg_text,
    arg_upper,
    help_command,
    option_pairs,
    parse_int,
)
from kvstrata.server.context import Ctx
from kvstrata.server.registry import Arg, Args, Reply, command, container

container("CLIENT", group="connection", summary="A container for client connection commands.")
_CLIENT_FLAGS = "noscript loading stale"
_CLIENT_TYPES = {b"normal", b"master", b"slave", b"replica", b"pubsub"}


def _printable(value: bytes) -> bool:
    return all(0x21 <= b <= 0x7E for b in value)


def client_name(arg: Any) -> bytes:
    """A connection name as CLIENT SETNAME and HELLO SETNAME accept it (no spaces)."""
    name = arg_bytes(arg)
    if not _printable(name):
        raise CommandError("Client names cannot contain spaces, newlines or special characters.")
    return name


def _client_type(arg: Any) -> bytes:
    kind = arg_bytes(arg).lower()
    if kind not in _CLIENT_TYPES:
        raise CommandError(f"Unknown client type '{arg_text(arg)}'")
    return kind


def _client_id(arg: Any, message: str) -> int:
    value = parse_int(arg, CommandError(message))
    if value < 1:
        raise CommandError(message)
    return value


# -- ID SETNAME GETNAME SETINFO -----------------------------------------------------------------
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
    ctx.client.name = client_name(args[2])
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
    if not _printable(value):
        raise CommandError(
            f"{arg_text(args[2])} cannot contain spaces, newlines or special characters."
        )
    if attr == b"LIB-NAME":
        ctx.client.lib_name = value
    else:
        ctx.client.lib_ver = value
    return OK


# -- NO-EVICT NO-TOUCH ---------------------------------------------------------------------------
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


# -- INFO LIST KILL ------------------------------------------------------------------------------
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
        Arg("client-type", "string", optional=True, token="TYPE"),
        Arg("client-id", "integer", optional=True, multiple=True, token="ID"),
    ),
    reply="Verbatim string: one line per connection.",
)
def client_list(ctx: Ctx, args: Args) -> Reply:
    ids: set[int] | None = None
    if len(args) == 4 and arg_upper(args[2]) == b"TYPE":
        if _client_type(args[3]) != b"normal":
            return Verbatim(b"")
    elif len(args) > 3 and arg_upper(args[2]) == b"ID":
        ids = {_client_id(a, "Invalid client ID") for a in args[3:]}
    elif len(args) != 2:
        raise syntax_error()
    now = time.monotonic()
    lines = [
        conn.client.describe(now) + "\n"
        for conn in list(ctx.server.clients.values())
        if ids is None or conn.client.id in ids
    ]
    return Verbatim("".join(lines).encode())


def _kill_filters(args: Args) -> dict[str, Any]:
    """Parse the new form ``CLIENT KILL <filter> <value> ...``."""
    filters: dict[str, Any] = {"skipme": True}
    for opt, value in option_pairs(args, 2):
        if opt == b"ID":
            filters["id"] = _client_id(value, "client-id should be greater than 0")
        elif opt == b"TYPE":
            filters["type"] = _client_type(value)
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


help_command(
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
    group="connection",
)
