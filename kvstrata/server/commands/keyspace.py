"""Key commands: SCAN KEYS EXISTS TYPE DEL UNLINK TTL PTTL EXPIRE PEXPIRE PERSIST, and the
keyspace-wide DBSIZE, FLUSHALL and MEMORY USAGE.

They work on every key in the keyspace, plain strings and KV chunks (``kv:{ns}:{hex}``)
alike. Deleting a chunk key goes through :meth:`Keyspace.delete`, which tells the store.
Semantics and error wording are Redis 7's.
"""

from __future__ import annotations

from kvstrata.protocol.errors import CommandError, syntax_error
from kvstrata.protocol.frames import OK, Simple
from kvstrata.server.commands._args import (
    INT64_MAX,
    arg_bytes,
    arg_text,
    arg_upper,
    help_command,
    option_pairs,
    parse_int,
)
from kvstrata.server.context import Ctx
from kvstrata.server.registry import Arg, Args, Reply, command, container
from kvstrata.store.keyspace import now_ms

_KEY = Arg("key", "key")
_KEYS = Arg("key", "key", multiple=True)


@command(
    "SCAN",
    -2,
    "readonly",
    group="generic",
    summary="Iterates over the key names (strings and KV chunks kv:{namespace}:{hex}).",
    complexity="O(1) for every call. O(N) for a complete iteration.",
    arguments=(
        Arg("cursor", "integer"),
        Arg("pattern", "pattern", optional=True, token="MATCH"),
        Arg("count", "integer", optional=True, token="COUNT"),
        Arg("type", "string", optional=True, token="TYPE"),
    ),
    reply="Array: the next cursor (bulk string, 0 when done) and an array of keys.",
)
def scan(ctx: Ctx, args: Args) -> Reply:
    data = arg_bytes(args[1])
    if not data.isdigit():
        raise CommandError("invalid cursor")
    cursor = int(data)
    if cursor >= 2**64:
        raise CommandError("invalid cursor")
    match: bytes | None = None
    type_name: str | None = None
    count = 10
    for opt, value in option_pairs(args, 2):
        if opt == b"COUNT":
            count = parse_int(value)
            if count < 1:
                raise syntax_error()
        elif opt == b"MATCH":
            match = arg_bytes(value)
        elif opt == b"TYPE":
            type_name = arg_text(value).lower()
        else:
            raise syntax_error()
    next_cursor, keys = ctx.server.keyspace.scan(cursor, count, match, type_name)
    return [str(next_cursor).encode(), keys]


@command(
    "KEYS",
    2,
    "readonly",
    group="generic",
    summary="Returns all key names that match a pattern.",
    complexity="O(N) with N being the number of keys in the database",
    arguments=(Arg("pattern", "pattern"),),
    reply="Array of keys.",
)
def keys(ctx: Ctx, args: Args) -> Reply:
    return ctx.server.keyspace.keys(arg_bytes(args[1]))


@command(
    "EXISTS",
    -2,
    "readonly fast",
    group="generic",
    summary="Determines whether one or more keys exist (a key named twice counts twice).",
    complexity="O(N) where N is the number of keys to check.",
    keys=(1, -1, 1),
    arguments=(_KEYS,),
    reply="Integer: the number of the given keys that exist.",
)
def exists(ctx: Ctx, args: Args) -> Reply:
    ks = ctx.server.keyspace
    return sum(1 for a in args[1:] if ks.lookup(arg_bytes(a)) is not None)


@command(
    "TYPE",
    2,
    "readonly fast",
    group="generic",
    summary="Determines the type of value stored at a key (string, kvchunk, or none).",
    keys=(1, 1, 1),
    arguments=(_KEY,),
    reply="Simple string: the type, or none when the key does not exist.",
)
def type_(ctx: Ctx, args: Args) -> Reply:
    entry = ctx.server.keyspace.lookup(arg_bytes(args[1]))
    return Simple(b"none" if entry is None else entry.type_name.encode())


def _delete(ctx: Ctx, args: Args) -> int:
    ks = ctx.server.keyspace
    return sum(1 for a in args[1:] if ks.delete(arg_bytes(a)))


@command(
    "DEL",
    -2,
    "write",
    group="generic",
    summary="Deletes one or more keys (a KV chunk key deletes the chunk from every tier).",
    complexity="O(N) where N is the number of keys that will be removed.",
    keys=(1, -1, 1),
    arguments=(_KEYS,),
    reply="Integer: the number of keys that were removed.",
)
def del_(ctx: Ctx, args: Args) -> Reply:
    return _delete(ctx, args)


@command(
    "UNLINK",
    -2,
    "write fast",
    group="generic",
    summary="Deletes one or more keys (same as DEL in kvstrata).",
    complexity="O(1) for each key removed.",
    keys=(1, -1, 1),
    arguments=(_KEYS,),
    reply="Integer: the number of keys that were unlinked.",
)
def unlink(ctx: Ctx, args: Args) -> Reply:
    return _delete(ctx, args)


def _ttl_ms(ctx: Ctx, key: bytes) -> int:
    entry = ctx.server.keyspace.lookup(key)
    if entry is None:
        return -2
    if entry.expire_at is None:
        return -1
    return max(0, entry.expire_at - now_ms())


@command(
    "TTL",
    2,
    "readonly fast",
    group="generic",
    summary="Returns the expiration time in seconds of a key.",
    keys=(1, 1, 1),
    arguments=(_KEY,),
    reply="Integer: seconds to live, -1 when the key has no TTL, -2 when it does not exist.",
)
def ttl(ctx: Ctx, args: Args) -> Reply:
    ms = _ttl_ms(ctx, arg_bytes(args[1]))
    return ms if ms < 0 else (ms + 500) // 1000


@command(
    "PTTL",
    2,
    "readonly fast",
    group="generic",
    summary="Returns the expiration time in milliseconds of a key.",
    keys=(1, 1, 1),
    arguments=(_KEY,),
    reply="Integer: ms to live, -1 when the key has no TTL, -2 when it does not exist.",
)
def pttl(ctx: Ctx, args: Args) -> Reply:
    return _ttl_ms(ctx, arg_bytes(args[1]))


def _expire_flags(args: Args) -> set[bytes]:
    flags: set[bytes] = set()
    for arg in args[3:]:
        opt = arg_upper(arg)
        if opt not in (b"NX", b"XX", b"GT", b"LT"):
            raise CommandError(f"Unsupported option {arg_text(arg)}")
        flags.add(opt)
    if b"NX" in flags and len(flags) > 1:
        raise CommandError("NX and XX, GT or LT options at the same time are not compatible")
    if {b"GT", b"LT"} <= flags:
        raise CommandError("GT and LT options at the same time are not compatible")
    return flags


def _allowed(flags: set[bytes], current: int | None, new: int) -> bool:
    if b"NX" in flags and current is not None:
        return False
    if b"XX" in flags and current is None:
        return False
    if b"GT" in flags and (current is None or new <= current):
        return False
    return not (b"LT" in flags and current is not None and new >= current)


def _expire(ctx: Ctx, args: Args, unit_ms: int, name: str) -> int:
    flags = _expire_flags(args)
    amount = parse_int(args[2])
    base = now_ms()
    at = amount * unit_ms + base
    if not -INT64_MAX <= amount * unit_ms <= INT64_MAX or not -INT64_MAX <= at <= INT64_MAX:
        raise CommandError(f"invalid expire time in '{name}' command")
    ks = ctx.server.keyspace
    key = arg_bytes(args[1])
    entry = ks.lookup(key)
    if entry is None or not _allowed(flags, entry.expire_at, at):
        return 0
    ks.set_expire(key, at)
    return 1


_EXPIRE_ARGS = (
    Arg(
        "condition",
        "oneof",
        optional=True,
        arguments=tuple(Arg(t.lower(), "pure-token", token=t) for t in ("NX", "XX", "GT", "LT")),
    ),
)


@command(
    "EXPIRE",
    -3,
    "write fast",
    group="generic",
    summary="Sets the expiration time of a key in seconds (NX, XX, GT, LT as in Redis 7).",
    keys=(1, 1, 1),
    arguments=(_KEY, Arg("seconds", "integer"), *_EXPIRE_ARGS),
    reply="Integer: 1 when the timeout was set, 0 when the key is missing or a condition failed.",
)
def expire(ctx: Ctx, args: Args) -> Reply:
    return _expire(ctx, args, 1000, "expire")


@command(
    "PEXPIRE",
    -3,
    "write fast",
    group="generic",
    summary="Sets the expiration time of a key in milliseconds (NX, XX, GT, LT).",
    keys=(1, 1, 1),
    arguments=(_KEY, Arg("milliseconds", "integer"), *_EXPIRE_ARGS),
    reply="Integer: 1 when the timeout was set, 0 when the key is missing or a condition failed.",
)
def pexpire(ctx: Ctx, args: Args) -> Reply:
    return _expire(ctx, args, 1, "pexpire")


@command(
    "PERSIST",
    2,
    "write fast",
    group="generic",
    summary="Removes the expiration time of a key.",
    keys=(1, 1, 1),
    arguments=(_KEY,),
    reply="Integer: 1 when the timeout was removed, 0 when the key is missing or has none.",
)
def persist(ctx: Ctx, args: Args) -> Reply:
    ks = ctx.server.keyspace
    key = arg_bytes(args[1])
    entry = ks.lookup(key)
    if entry is None or entry.expire_at is None:
        return 0
    ks.set_expire(key, None)
    return 1


# -- DBSIZE FLUSHALL MEMORY ----------------------------------------------------------------------
@command(
    "DBSIZE",
    1,
    "readonly fast",
    group="server",
    summary="Returns the number of keys (strings and KV chunks).",
    reply="Integer.",
)
def dbsize(ctx: Ctx, args: Args) -> Reply:
    return len(ctx.server.keyspace)


@command(
    "FLUSHALL",
    -1,
    "write",
    group="server",
    summary="Removes all keys, KV chunks included (from every tier).",
    complexity="O(N) where N is the total number of keys",
    arguments=(
        Arg(
            "flush-type",
            "oneof",
            optional=True,
            arguments=(
                Arg("async", "pure-token", token="ASYNC"),
                Arg("sync", "pure-token", token="SYNC"),
            ),
        ),
    ),
    reply="Simple string OK.",
)
def flushall(ctx: Ctx, args: Args) -> Reply:
    if len(args) > 2 or (len(args) == 2 and arg_upper(args[1]) not in (b"ASYNC", b"SYNC")):
        raise syntax_error()
    ctx.server.keyspace.flush()
    return OK


container("MEMORY", group="server", summary="A container for memory diagnostics commands.")


@command(
    "MEMORY|USAGE",
    -3,
    "readonly",
    group="server",
    summary="Estimates the memory usage of a key (for a KV chunk: its payload and record).",
    complexity="O(1)",
    keys=(2, 2, 1),
    arguments=(_KEY, Arg("count", "integer", optional=True, token="SAMPLES")),
    reply="Integer: bytes, or null when the key does not exist.",
)
def memory_usage(ctx: Ctx, args: Args) -> Reply:
    if len(args) not in (3, 5):
        raise syntax_error()
    if len(args) == 5 and (arg_upper(args[3]) != b"SAMPLES" or parse_int(args[4]) < 0):
        raise syntax_error()
    key = arg_bytes(args[2])
    entry = ctx.server.keyspace.lookup(key)
    return None if entry is None else entry.memory_usage() + len(key)


help_command(
    "MEMORY",
    [
        "USAGE <key> [SAMPLES <count>]",
        "    Return memory in bytes used by <key> and its value.",
    ],
    group="server",
)
