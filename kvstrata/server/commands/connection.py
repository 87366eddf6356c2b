"""Connection commands: PING ECHO HELLO AUTH SELECT QUIT RESET (CLIENT is in ``client``).

Semantics and error wording follow Redis 7 so that redis-cli and redis-py work unchanged.
There is one user, ``default``, whose password is ``requirepass`` (none when empty); there is
one database, 0.
"""

from __future__ import annotations

import hmac

import kvstrata
from kvstrata.protocol.errors import (
    CommandError,
    NoAuthError,
    NoProtoError,
    WrongPassError,
    syntax_error,
)
from kvstrata.protocol.frames import OK, PONG, Simple

# arg_bytes, parse_int and unknown_subcommand are also imported from here by modules written
# before _args existed (kv*.py, tests/fakectx.py).
from kvstrata.server.commands._args import REDACTED, arg_bytes, arg_text, arg_upper, parse_int
from kvstrata.server.commands._args import unknown_subcommand as unknown_subcommand
from kvstrata.server.commands.client import client_name
from kvstrata.server.context import Ctx
from kvstrata.server.registry import Arg, Args, Reply, command

REDIS_COMPAT_VERSION = "7.2.0"


# -- PING ECHO SELECT QUIT -------------------------------------------------------------------
@command(
    "PING",
    -1,
    "fast loading",  # unlike Redis, answered while loading: health checks pass at once
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
            name = client_name(args[i + 1])
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
