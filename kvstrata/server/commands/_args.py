"""Argument helpers shared by the command modules, and the shape of a container's HELP.

Arguments arrive as ``bytes``, ``bytearray`` or ``memoryview`` (see ``registry``); these
helpers read them the way Redis does: :func:`parse_int` accepts exactly what ``string2ll``
accepts, :func:`option_pairs` walks ``OPTION value`` tails. Importing this module registers
no command.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from kvstrata.protocol.errors import CommandError, not_integer, syntax_error
from kvstrata.protocol.frames import Simple
from kvstrata.server.context import Ctx
from kvstrata.server.registry import Args, Reply, command

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: What a secret argument (a password) is replaced with, so that the slow log and MONITOR
#: never see it.
REDACTED = b"(redacted)"
_INT_RE = re.compile(rb"0|-?[1-9][0-9]{0,18}")


def int_option(arg: Any, what: str, lo: int, hi: int) -> int:
    """An integer option's value, ``lo`` to ``hi``; the error names the option."""
    try:
        value = parse_int(arg)  # the error is built only when needed (64 per KV.MRESERVE)
    except CommandError:
        raise CommandError(f"invalid {what}: value is not an integer") from None
    if not lo <= value <= hi:
        raise CommandError(f"invalid {what}: must be {lo} to {hi}, got {value}")
    return value


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
        if INT64_MIN <= value <= INT64_MAX:
            return value
    raise error if error is not None else not_integer()


def option_pairs(args: Args, start: int) -> Iterator[tuple[bytes, Any]]:
    """``(OPTION, value)`` for each pair of ``args[start:]``, the option upper-cased.

    Lazy, so that an error in an earlier pair is raised before a missing value at the end
    (a syntax error), as Redis's option loops do.
    """
    for i in range(start, len(args), 2):
        if i + 1 >= len(args):
            raise syntax_error()
        yield arg_upper(args[i]), args[i + 1]


def unknown_subcommand(container: str, sub: Any) -> CommandError:
    """``ERR unknown subcommand 'x'. Try CLIENT HELP.``"""
    name = arg_text(sub)[:128]
    return CommandError(f"unknown subcommand '{name}'. Try {container.upper()} HELP.")


def help_reply(container: str, lines: list[str]) -> list[Simple]:
    """The reply of ``X HELP``: simple strings, as Redis's ``addReplyHelp``."""
    head = f"{container} <subcommand> [<arg> [value] [opt] ...]. Subcommands are:"
    tail = ["HELP", "    Print this help."]
    return [Simple(line.encode()) for line in [head, *lines, *tail]]


def help_command(
    container: str,
    lines: list[str],
    *,
    group: str,
    summary: str = "Returns helpful text about the different subcommands.",
) -> None:
    """Register ``CONTAINER|HELP``, answering :func:`help_reply` with ``lines``."""
    reply = help_reply(container, lines)

    @command(
        f"{container}|HELP",
        2,
        "loading stale",
        group=group,
        summary=summary,
        reply="Array of simple strings.",
    )
    def help_(ctx: Ctx, args: Args) -> Reply:
        return list(reply)
