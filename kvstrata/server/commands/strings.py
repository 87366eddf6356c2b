"""Plain string commands: GET, STRLEN and SET (metadata next to the cache, or whole values
for clients that only speak GET/SET, such as LMCache's ``redis://`` connector).

KV chunk keys (``kv:{ns}:{hex}``) are not strings: GET on one answers WRONGTYPE (their
payloads are read with KV.GET); SET on one replaces the chunk, as Redis's SET replaces a key of
any type. Where values live and how ``maxmemory`` counts them is ``kvstrata.store.strings``:
small values stay in the heap; large ones go to the tiers and GET replies straight from the
DRAM arena (or reads them back from NVMe).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstrata.protocol.errors import CommandError, WrongTypeError, syntax_error
from kvstrata.protocol.frames import OK, BulkView
from kvstrata.server.commands._args import INT64_MAX, arg_bytes, arg_upper, parse_int
from kvstrata.server.context import Ctx
from kvstrata.server.registry import Arg, Args, Reply, command
from kvstrata.store.keyspace import Entry, StringEntry, now_ms
from kvstrata.store.kvstore.state import NOT_NOW
from kvstrata.store.strings import LargeEntry, StringStore


def _set_sink(ctx: Any, args_so_far: list[Any], nbytes: int) -> Any:
    """A DRAM slot for a large SET value (argument 2), else None (received into a buffer)."""
    strings = getattr(ctx.server, "strings", None)
    if len(args_so_far) != 2 or strings is None:
        return None
    return strings.reserve_sink(nbytes)


def wrong_type() -> WrongTypeError:
    return WrongTypeError("Operation against a key holding the wrong kind of value")


def _check_string(entry: Entry | None) -> StringEntry | LargeEntry | None:
    if entry is not None and not isinstance(entry, StringEntry | LargeEntry):
        raise wrong_type()
    return entry


def _payload_reply(payload: Any) -> Reply:
    return None if payload is None else BulkView(payload.view, payload.release)


async def _read_slow(strings: StringStore, key: bytes, entry: LargeEntry) -> Reply:
    return _payload_reply(await strings.read_large(key, entry))


def _value_reply(strings: StringStore, key: bytes, entry: StringEntry | LargeEntry | None) -> Reply:
    """The value as a reply: bytes, a zero-copy view of the arena, or a coroutine to await."""
    if entry is None or isinstance(entry, StringEntry):
        return None if entry is None else entry.value
    payload = strings.read_large_now(key, entry)
    if payload is NOT_NOW:
        return _read_slow(strings, key, entry)
    return _payload_reply(payload)


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
    strings = ctx.server.strings
    key = arg_bytes(args[1])
    return _value_reply(strings, key, _check_string(strings.lookup(key)))


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
    entry = _check_string(ctx.server.keyspace.lookup(arg_bytes(args[1])))
    if entry is None:
        return 0
    return len(entry.value) if isinstance(entry, StringEntry) else entry.size


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
    sink=_set_sink,
    reply="Simple string OK; null when NX/XX prevented the write; with GET, the old value "
    "(or null). Error `-OOM command not allowed when used memory > 'maxmemory'.` when the "
    "value does not fit under maxmemory and maxmemory-policy may not evict (noeviction, or no "
    "key with a TTL for volatile-*); `-OOM cannot place …` when a large value fits in no tier.",
)
def set_(ctx: Ctx, args: Args) -> Reply:
    opts = parse_set_options(args)
    strings = ctx.server.strings
    key = arg_bytes(args[1])
    old = ctx.server.keyspace.lookup(key)
    if opts.get:
        old = _check_string(old)
    if (opts.nx and old is not None) or (opts.xx and old is None):
        return _value_reply(strings, key, old) if opts.get else None  # type: ignore[arg-type]
    expire_at = opts.expire_at
    if opts.keepttl and old is not None:
        expire_at = old.expire_at
    sink = ctx.sinks.get(2)  # a large value received straight into a DRAM slot
    if opts.get and isinstance(old, LargeEntry):
        return _set_after_read(strings, key, old, args[2], expire_at, sink)
    old_value = old.value if opts.get and isinstance(old, StringEntry) else None
    if old is not None and not isinstance(old, StringEntry | LargeEntry):
        ctx.server.keyspace.delete(key)  # the owner of a chunk must hear that it is gone
    pending = strings.store(key, args[2], expire_at, sink)
    reply: Reply = old_value if opts.get else OK
    if pending is not None:
        return _finish(pending, reply)  # a coroutine: the connection awaits it, in order
    return reply


async def _finish(pending: Any, reply: Reply) -> Reply:
    await pending
    return reply


async def _set_after_read(
    strings: StringStore, key: bytes, old: LargeEntry, value: Any, expire_at: int | None,
    sink: Any,
) -> Reply:  # fmt: skip
    """SET … GET over a large value: its bytes are copied out before they are replaced."""
    reply = _value_reply(strings, key, old)
    if not isinstance(reply, BulkView | type(None)):
        reply = await reply
    old_bytes = None
    if isinstance(reply, BulkView):
        try:
            old_bytes = bytes(reply.view)
        finally:
            if reply.release is not None:
                reply.release()
    pending = strings.store(key, value, expire_at, sink)
    if pending is not None:
        await pending
    return old_bytes
