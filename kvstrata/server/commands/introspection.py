"""Introspection commands: COMMAND (COUNT INFO DOCS LIST) and SLOWLOG (GET LEN RESET).

COMMAND answers from the command table, so COMMAND DOCS and ``docs/commands.md`` come from
the same definitions as dispatch. Flags go out as simple strings, as Redis sends them
(redis-cli's hints check the type). The slow log itself is ``kvstrata.server.slowlog``.
"""

from __future__ import annotations

from typing import Any

from kvstrata.protocol.errors import CommandError, syntax_error
from kvstrata.protocol.frames import OK
from kvstrata.server.commands._args import arg_bytes, arg_upper, help_command, parse_int
from kvstrata.server.context import Ctx
from kvstrata.server.registry import Arg, Args, CommandSpec, CommandTable, Reply, command, container
from kvstrata.store.glob import glob_match


# -- COMMAND -------------------------------------------------------------------------------------
def find_spec(table: CommandTable, name: Any) -> CommandSpec | None:
    """A command or ``container|sub`` by name (case-insensitive)."""
    parent, _, sub = arg_bytes(name).lower().partition(b"|")
    spec = table.lookup(parent)
    if spec is not None and sub:
        return spec.subcommands.get(sub.decode("utf-8", "replace").upper())
    return spec


@command(
    "COMMAND",
    -1,
    "loading stale",
    group="server",
    summary="Returns detailed information about all commands.",
    complexity="O(N) where N is the total number of commands",
    reply="Array of COMMAND INFO entries.",
)
def command_(ctx: Ctx, args: Args) -> Reply:
    return [spec.info() for spec in ctx.server.registry]


@command(
    "COMMAND|COUNT",
    2,
    "loading stale",
    group="server",
    summary="Returns a count of commands.",
    reply="Integer: the number of top-level commands.",
)
def command_count(ctx: Ctx, args: Args) -> Reply:
    return len(ctx.server.registry)


@command(
    "COMMAND|INFO",
    -2,
    "loading stale",
    group="server",
    summary="Returns information about one, multiple or all commands.",
    complexity="O(N) where N is the number of commands to look up",
    arguments=(Arg("command-name", "string", optional=True, multiple=True),),
    reply="Array: one COMMAND INFO entry per name (null for an unknown name).",
)
def command_info(ctx: Ctx, args: Args) -> Reply:
    table = ctx.server.registry
    if len(args) == 2:
        return [spec.info() for spec in table]
    return [None if (s := find_spec(table, a)) is None else s.info() for a in args[2:]]


@command(
    "COMMAND|DOCS",
    -2,
    "loading stale",
    group="server",
    summary="Returns documentary information about one, multiple or all commands.",
    complexity="O(N) where N is the number of commands to look up",
    arguments=(Arg("command-name", "string", optional=True, multiple=True),),
    reply="Map of command names to their docs (unknown names are left out).",
)
def command_docs(ctx: Ctx, args: Args) -> Reply:
    table = ctx.server.registry
    if len(args) == 2:
        return {spec.wire_name: spec.docs() for spec in table}
    out: dict[str, Any] = {}
    for name in args[2:]:
        spec = find_spec(table, name)
        if spec is not None:
            out[spec.wire_name] = spec.docs()
    return out


def _all_names(table: CommandTable) -> list[tuple[str, CommandSpec]]:
    out = []
    for spec in table:
        out.append((spec.wire_name, spec))
        out += [(sub.wire_name, sub) for sub in spec.subcommands.values()]
    return out


@command(
    "COMMAND|LIST",
    -2,
    "loading stale",
    group="server",
    summary="Returns a list of command names (subcommands as container|sub).",
    complexity="O(N) where N is the total number of commands",
    arguments=(
        Arg(
            "filterby",
            "oneof",
            optional=True,
            token="FILTERBY",
            arguments=(
                Arg("module-name", "string", token="MODULE"),
                Arg("category", "string", token="ACLCAT"),
                Arg("pattern", "pattern", token="PATTERN"),
            ),
        ),
    ),
    reply="Array of command names.",
)
def command_list(ctx: Ctx, args: Args) -> Reply:
    names = _all_names(ctx.server.registry)
    if len(args) == 2:
        return [name for name, _ in names]
    if len(args) != 5 or arg_upper(args[2]) != b"FILTERBY":
        raise syntax_error()
    kind, value = arg_upper(args[3]), arg_bytes(args[4])
    if kind == b"PATTERN":
        return [n for n, _ in names if glob_match(value.lower(), n.encode())]
    if kind == b"ACLCAT":
        category = value.decode("utf-8", "replace").lower().lstrip("@")
        return [n for n, spec in names if spec.group == category]
    if kind == b"MODULE":
        return []
    raise syntax_error()


help_command(
    "COMMAND",
    [
        "(no subcommand)",
        "    Return details about all commands.",
        "COUNT",
        "    Return the total number of commands in this server.",
        "LIST [FILTERBY (MODULE <module-name>|ACLCAT <category>|PATTERN <pattern>)]",
        "    Return a list of all commands in this server.",
        "INFO [<command-name> ...]",
        "    Return details about multiple commands.",
        "DOCS [<command-name> ...]",
        "    Return documentation details about multiple commands.",
    ],
    group="server",
)


# -- SLOWLOG -------------------------------------------------------------------------------------
container("SLOWLOG", group="server", summary="A container for slow log commands.")


@command(
    "SLOWLOG|GET",
    -2,
    "admin loading stale",
    group="server",
    summary="Returns the newest slow log entries (10 by default, all with -1).",
    complexity="O(N) where N is the number of entries returned",
    arguments=(Arg("count", "integer", optional=True),),
    reply="Array of entries: id, unix time, duration in microseconds, arguments, client "
    "address, client name.",
)
def slowlog_get(ctx: Ctx, args: Args) -> Reply:
    if len(args) > 3:
        raise syntax_error()
    count = 10
    if len(args) == 3:
        error = CommandError("count should be greater than or equal to -1")
        count = parse_int(args[2], error)
        if count < -1:
            raise error
    return [entry.reply() for entry in ctx.server.slowlog.get(count)]


@command(
    "SLOWLOG|LEN",
    2,
    "admin loading stale",
    group="server",
    summary="Returns the number of entries in the slow log.",
    reply="Integer.",
)
def slowlog_len(ctx: Ctx, args: Args) -> Reply:
    return len(ctx.server.slowlog)


@command(
    "SLOWLOG|RESET",
    2,
    "admin loading stale",
    group="server",
    summary="Clears all entries from the slow log.",
    complexity="O(N) where N is the number of entries in the slowlog",
    reply="Simple string OK.",
)
def slowlog_reset(ctx: Ctx, args: Args) -> Reply:
    ctx.server.slowlog.reset()
    return OK


help_command(
    "SLOWLOG",
    [
        "GET [<count>]",
        "    Return top <count> entries from the slowlog (default: 10, -1 mean all).",
        "    Entries are made of:",
        "    id, timestamp, time in microseconds, arguments array, client IP and port,",
        "    client name",
        "LEN",
        "    Return the length of the slowlog.",
        "RESET",
        "    Reset the slowlog.",
    ],
    group="server",
    summary="Shows helpful text about the different subcommands.",
)
