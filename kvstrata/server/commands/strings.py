"""Plain string commands: GET and SET, for small metadata an engine keeps next to its cache.

KV chunk keys (``kv:{ns}:{hex}``) are not strings: GET on one answers WRONGTYPE (their
payloads are read with KV.GET); SET on one replaces the chunk, as Redis's SET replaces a key of
any type. Large values arrive as ``bytearray`` and are kept as they are (no copy); a
``memoryview`` value is copied, since it may point into a receive buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstrata.protocol.errors import CommandError, WrongTypeError, syntax_error
from kvstrata.protocol.frames import OK
from kvstrata.server.commands._args import INT64_MAX, arg_bytes, arg_upper, parse_int
from kvstrata.server.context import Ctx
from kvstrata.server.registry import Arg, Args, Reply, command
from kvstrata.store.keyspace import Entry, StringEntry, now_ms


def wrong_type() -> WrongTypeError:
    return WrongTypeError("Operation against a key holding the wrong kind of value")


def _string_value(entry: Entry | None) -> bytes | bytearray | None:
    if entry is None:
        return None
    if not isinstance(entry, StringEntry):
        raise wrong_type()
    return entry.value


@command(
    "GET",
    2,
    "readonly fast",
    group="string",
    summary="Returns the string value of a key. KV chunk keys answer WRONGTYPE: read chunk "
    "payloads with KV.GET.",
    keys=(1, 1, 1),
    arguments=(Arg("key", "key"),),
    reply="Bulk string: the value, or null when the key does not exist.",
)
def get(ctx: Ctx, args: Args) -> Reply:
    return _string_value(ctx.server.keyspace.get_string(arg_bytes(args[1])))


@command(
    "STRLEN",
    2,
    "readonly fast",
    group="string",
    summary="Returns the length of a string value (KV chunk keys answer WRONGTYPE).",
    keys=(1, 1, 1),
    arguments=(Arg("key", "key"),),
    reply="Integer: the length, 0 when the key does not exist.",
)
def strlen(ctx: Ctx, args: Args) -> Reply:
    value = _string_value(ctx.server.keyspace.lookup(arg_bytes(args[1])))
    return 0 if value is None else len(value)


@dataclass(slots=True)
class SetOptions:
    nx: bool = False
    xx: bool = False
    get: bool = False
    keepttl: bool = False
    expire_at: int | None = None  # absolute ms


_EXPIRY_UNITS = {b"EX": (1000, True), b"PX": (1, True), b"EXAT": (1000, False),
                 b"PXAT": (1, False)}  # fmt: skip


def _expire_ms(raw: Any, unit_ms: int, relative: bool) -> int:
    value = parse_int(raw)
    if value <= 0 or value > INT64_MAX // unit_ms:
        raise CommandError("invalid expire time in 'set' command")
    value *= unit_ms
    if relative:
        base = now_ms()
        if value > INT64_MAX - base:
            raise CommandError("invalid expire time in 'set' command")
        value += base
    return value


def parse_set_options(args: Args) -> SetOptions:
    """Parse ``[NX|XX] [GET] [EX s|PX ms|EXAT t|PXAT t|KEEPTTL]`` as Redis 7 does."""
    opts = SetOptions()
    expiry: tuple[bytes, Any] | None = None
    i = 3
    while i < len(args):
        opt = arg_upper(args[i])
        has_next = i + 1 < len(args)
        if opt == b"NX" and not opts.xx:
            opts.nx = True
        elif opt == b"XX" and not opts.nx:
            opts.xx = True
        elif opt == b"GET":
            opts.get = True
        elif opt == b"KEEPTTL" and expiry is None:
            opts.keepttl = True
        elif opt in _EXPIRY_UNITS and not opts.keepttl and has_next:
            if expiry is not None and expiry[0] != opt:
                raise syntax_error()
            expiry = (opt, args[i + 1])
            i += 1
        else:
            raise syntax_error()
        i += 1
    if expiry is not None:
        opts.expire_at = _expire_ms(expiry[1], *_EXPIRY_UNITS[expiry[0]])
    return opts


def _store_value(raw: Any) -> bytes | bytearray:
    if isinstance(raw, bytes | bytearray):
        return raw
    return bytes(raw)


@command(
    "SET",
    -3,
    "write denyoom",
    group="string",
    summary="Sets the string value of a key, with Redis 7's options; replaces a key of any type.",
    keys=(1, 1, 1),
    arguments=(
        Arg("key", "key"),
        Arg("value", "string"),
        Arg(
            "condition",
            "oneof",
            optional=True,
            arguments=(Arg("nx", "pure-token", token="NX"), Arg("xx", "pure-token", token="XX")),
        ),
        Arg("get", "pure-token", optional=True, token="GET"),
        Arg(
            "expiration",
            "oneof",
            optional=True,
            arguments=(
                Arg("seconds", "integer", token="EX"),
                Arg("milliseconds", "integer", token="PX"),
                Arg("unix-time-seconds", "unix-time", token="EXAT"),
                Arg("unix-time-milliseconds", "unix-time", token="PXAT"),
                Arg("keepttl", "pure-token", token="KEEPTTL"),
            ),
        ),
    ),
    reply="Simple string OK; null when NX/XX prevented the write; with GET, the old value "
    "(or null).",
)
def set_(ctx: Ctx, args: Args) -> Reply:
    opts = parse_set_options(args)
    ks = ctx.server.keyspace
    key = arg_bytes(args[1])
    old = ks.lookup(key)
    old_value = _string_value(old) if opts.get else None
    if (opts.nx and old is not None) or (opts.xx and old is None):
        return old_value
    expire_at = opts.expire_at
    if opts.keepttl and old is not None:
        expire_at = old.expire_at
    if old is not None and not isinstance(old, StringEntry):
        ks.delete(key)  # the owner of a chunk must hear that it is gone
    ks.insert(key, StringEntry(_store_value(args[2]), expire_at))
    return old_value if opts.get else OK
