"""Server commands: INFO CONFIG TIME MONITOR SHUTDOWN (COMMAND and SLOWLOG are in
``introspection``).

INFO reports ``redis_version:7.2.0`` (the Redis compatibility level clients check) next to
``kvstrata_version``, and appends every section the store reports (``tiers``,
``persistence``…). CONFIG reads and sets the options of ``kvstrata.config``, all or none.
"""

from __future__ import annotations

import os
import platform
import resource
import sys
import time

import kvstrata
from kvstrata.config import ConfigError, apply_loglevel, option
from kvstrata.protocol.errors import CommandError, syntax_error
from kvstrata.protocol.frames import NO_REPLY, OK
from kvstrata.server.commands._args import REDACTED, arg_bytes, arg_text, arg_upper, help_command
from kvstrata.server.commands.connection import REDIS_COMPAT_VERSION
from kvstrata.server.context import Ctx
from kvstrata.server.registry import Arg, Args, Reply, command, container
from kvstrata.store.glob import glob_match

_ADMIN = "admin noscript loading stale"
Fields = list[tuple[str, object]]


# -- INFO --------------------------------------------------------------------------------------
def human_bytes(n: int) -> str:
    """Redis's ``bytesToHuman``: 1023B, 1.00K, 2.50M, 1.00G…"""
    for unit, size in (("P", 1024**5), ("T", 1024**4), ("G", 1024**3), ("M", 1024**2)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n / 1024:.2f}K" if n >= 1024 else f"{n}B"


def _fmt(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, dict):
        return ",".join(f"{k}={_fmt(v)}" for k, v in value.items())
    return str(value)


def _server_fields(ctx: Ctx) -> Fields:
    srv = ctx.server
    uptime = int(time.time() - srv.start_time)
    return [
        ("redis_version", REDIS_COMPAT_VERSION),
        ("kvstrata_version", kvstrata.__version__),
        ("redis_mode", "standalone"),
        ("os", f"{platform.system()} {platform.release()} {platform.machine()}"),
        ("arch_bits", 64 if sys.maxsize > 2**32 else 32),
        ("multiplexing_api", "asyncio"),
        ("python_version", platform.python_version()),
        ("process_id", os.getpid()),
        ("run_id", srv.run_id),
        ("tcp_port", srv.port),
        ("server_time_usec", time.time_ns() // 1000),
        ("uptime_in_seconds", uptime),
        ("uptime_in_days", uptime // 86400),
        ("hz", 10),
        ("executable", os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""),
        ("config_file", srv.config_file),
    ]


def _memory_fields(ctx: Ctx) -> Fields:
    used = ctx.server.used_memory()
    strings = ctx.server.strings
    maxmemory = strings.limit  # what is enforced (maxmemory 0 means dram-capacity)
    return [
        ("used_memory", used),
        ("used_memory_human", human_bytes(used)),
        ("used_memory_rss", used),
        ("used_memory_rss_human", human_bytes(used)),
        ("used_memory_strings", strings.used),  # what maxmemory counts (kvstrata.store.strings)
        ("used_memory_strings_human", human_bytes(strings.used)),
        ("maxmemory", maxmemory),
        ("maxmemory_human", human_bytes(maxmemory)),
        ("maxmemory_policy", strings.policy),
    ]


def _loading_fields(ctx: Ctx) -> Fields:
    """Redis's loading fields: 1 from the moment the port is bound until the store is ready."""
    srv = ctx.server
    fields: Fields = [("loading", int(srv.loading)), ("async_loading", 0)]
    if srv.loading:
        fields += [
            ("loading_start_time", int(srv.loading_start_time)),
            ("loading_eta_seconds", -1),
            ("loading_elapsed_seconds", int(time.time() - srv.loading_start_time)),
        ]
    return fields


def _stats_fields(ctx: Ctx) -> Fields:
    stats, ks = ctx.server.stats, ctx.server.keyspace
    return [
        ("total_connections_received", stats.total_connections_received),
        ("total_commands_processed", stats.total_commands_processed),
        ("total_net_input_bytes", stats.total_net_input_bytes),
        ("total_net_output_bytes", stats.total_net_output_bytes),
        ("rejected_connections", stats.rejected_connections),
        ("client_output_buffer_limit_disconnections", stats.output_limit_disconnections),
        ("reply_pin_copyouts", stats.reply_copyouts),
        ("reply_pin_copied_bytes", stats.reply_copied_bytes),
        ("reply_pin_disconnections", stats.reply_pin_disconnections),
        ("expired_keys", ks.expired_keys),
        ("evicted_keys", ctx.server.strings.evicted_keys),
        ("keyspace_hits", ks.hits),
        ("keyspace_misses", ks.misses),
        ("total_error_replies", stats.total_error_replies),
        ("protocol_errors", stats.protocol_errors),
        ("unexpected_errors", stats.unexpected_errors),
    ]


def _cpu_fields() -> Fields:
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return [
        ("used_cpu_sys", f"{me.ru_stime:.6f}"),
        ("used_cpu_user", f"{me.ru_utime:.6f}"),
        ("used_cpu_sys_children", f"{kids.ru_stime:.6f}"),
        ("used_cpu_user_children", f"{kids.ru_utime:.6f}"),
    ]


def info_sections(ctx: Ctx) -> dict[str, Fields]:
    """Every INFO section by lower-case name, in output order (store sections merged in)."""
    srv = ctx.server
    ks = srv.keyspace
    sections: dict[str, Fields] = {
        "server": _server_fields(ctx),
        "clients": [
            ("connected_clients", len(srv.clients)),
            ("maxclients", srv.config.get("maxclients")),
            ("blocked_clients", 0),
            ("monitor_clients", len(srv.monitors)),
        ],
        "memory": _memory_fields(ctx),
        "persistence": _loading_fields(ctx),
        "stats": _stats_fields(ctx),
        "replication": [("role", "master"), ("connected_slaves", 0)],
        "cpu": _cpu_fields(),
    }
    store_sections = srv.store.info_sections() if srv.store is not None else {}
    for name, fields in store_sections.items():
        sections.setdefault(name.lower(), []).extend(fields)
    sections["commandstats"] = srv.cmdstats.info_commandstats()
    sections["errorstats"] = srv.cmdstats.info_errorstats()
    keys = len(ks)
    sections["keyspace"] = (
        [("db0", f"keys={keys},expires={ks.count_expiring()},avg_ttl=0")] if keys else []
    )
    return sections


_NOT_DEFAULT = ("commandstats", "errorstats")


def render_info(sections: dict[str, Fields], wanted: list[str]) -> bytes:
    """The INFO text for the requested section names (``default``/``all``/``everything``;
    as in Redis, commandstats and errorstats are left out of the default set)."""
    if any(w in ("all", "everything") for w in wanted):
        names = list(sections)
    elif not wanted or "default" in wanted:
        names = [n for n in sections if n not in _NOT_DEFAULT or n in wanted]
    else:
        names = [n for n in sections if n in wanted]
    parts = []
    for name in names:
        lines = [f"# {name.capitalize()}"]
        lines += [f"{key}:{_fmt(value)}" for key, value in sections[name]]
        parts.append("\r\n".join(lines) + "\r\n")
    return "\r\n".join(parts).encode()


@command(
    "INFO",
    -1,
    "loading stale",
    group="server",
    summary="Returns information and statistics about the server, including the store's tiers.",
    complexity="O(1)",
    arguments=(Arg("section", "string", optional=True, multiple=True),),
    reply="Bulk string: `# Section` headers and `field:value` lines ending in CRLF.",
)
def info(ctx: Ctx, args: Args) -> Reply:
    wanted = [arg_text(a).lower() for a in args[1:]]
    return render_info(info_sections(ctx), wanted)


# -- CONFIG ------------------------------------------------------------------------------------
container("CONFIG", group="server", summary="A container for server configuration commands.")


@command(
    "CONFIG|GET",
    -3,
    _ADMIN,
    group="server",
    summary="Returns the effective values of configuration parameters (glob patterns). A "
    "secret (requirepass) is only returned when asked for by its exact name.",
    complexity="O(N) when N is the number of configuration parameters provided",
    arguments=(Arg("parameter", "string", multiple=True),),
    reply="Map of parameter names to values.",
)
def config_get(ctx: Ctx, args: Args) -> Reply:
    config = ctx.server.config
    out: dict[str, str] = {}
    for raw in args[2:]:
        pattern = arg_bytes(raw).lower()
        for name, value in [*config.items(), *_COMPAT.items()]:
            if name in out or not glob_match(pattern, name.encode()):
                continue
            opt = option(name)
            if opt is not None and opt.secret and pattern != name.encode():
                continue
            out[name] = value
    return out


#: read-only Redis keys that tools read (redis-benchmark asks for save and appendonly)
_COMPAT = {"save": "", "appendonly": "no"}


def _set_failed(name: str, why: str) -> CommandError:
    return CommandError(f"CONFIG SET failed (possibly related to argument '{name}') - {why}")


def _set_error(name: str, exc: ConfigError) -> CommandError:
    message = str(exc)
    if message.startswith("invalid value"):
        return _set_failed(name, message)
    return CommandError(message)


@command(
    "CONFIG|SET",
    -4,
    _ADMIN,
    group="server",
    summary="Sets configuration parameters at run time, all or none.",
    complexity="O(N) when N is the number of configuration parameters provided",
    arguments=(
        Arg(
            "data",
            "block",
            multiple=True,
            arguments=(Arg("parameter", "string"), Arg("value", "string")),
        ),
    ),
    reply="Simple string OK.",
)
def config_set(ctx: Ctx, args: Args) -> Reply:
    if len(args) % 2:
        raise CommandError("wrong number of arguments for 'config|set' command")
    pairs = [(arg_text(args[i]).lower(), arg_text(args[i + 1])) for i in range(2, len(args), 2)]
    for i, (name, _) in enumerate(pairs):  # first, before anything can fail (as Redis)
        opt = option(name)
        if opt is not None and opt.secret:
            args[3 + 2 * i] = REDACTED  # keeps secrets out of the slow log and MONITOR
    names = [n for n, _ in pairs]
    for name in names:
        if names.count(name) > 1:
            raise _set_failed(name, "duplicate parameter")
    config = ctx.server.config
    saved = dict(config.values)
    name = ""
    try:
        for name, value in pairs:
            config.set(name, value, check=False)
        config.check()  # rules across keys (watermarks) hold for the whole set, in any order
    except ConfigError as exc:
        config.values.clear()
        config.values.update(saved)
        raise _set_error(name, exc) from None
    if "loglevel" in names:
        apply_loglevel(config.loglevel)
    return OK


@command(
    "CONFIG|RESETSTAT",
    2,
    _ADMIN,
    group="server",
    summary="Resets the server's statistics (INFO stats, keyspace hits and misses).",
    reply="Simple string OK.",
)
def config_resetstat(ctx: Ctx, args: Args) -> Reply:
    srv = ctx.server
    srv.stats.reset()
    srv.cmdstats.reset()
    srv.keyspace.hits = srv.keyspace.misses = srv.keyspace.expired_keys = 0
    srv.strings.evicted_keys = 0
    return OK


help_command(
    "CONFIG",
    [
        "GET <pattern>",
        "    Return parameters matching the glob-like <pattern> and their values.",
        "SET <directive> <value>",
        "    Set the configuration <directive> to <value>.",
        "RESETSTAT",
        "    Reset statistics reported by the INFO command.",
    ],
    group="server",
)


# -- TIME MONITOR SHUTDOWN ------------------------------------------------------------------
@command(
    "TIME",
    1,
    "loading stale fast",
    group="server",
    summary="Returns the server time.",
    reply="Array: unix seconds and microseconds, as bulk strings.",
)
def time_(ctx: Ctx, args: Args) -> Reply:
    sec, usec = divmod(time.time_ns() // 1000, 1_000_000)
    return [str(sec).encode(), str(usec).encode()]


@command(
    "MONITOR",
    1,
    _ADMIN,
    group="server",
    summary="Listens for all requests received by the server in real time.",
    reply="Simple string OK, then one simple string per command run by other clients.",
)
def monitor(ctx: Ctx, args: Args) -> Reply:
    ctx.start_monitor()
    return OK


_SHUTDOWN_OPTS = {b"NOSAVE", b"SAVE", b"NOW", b"FORCE", b"ABORT"}


@command(
    "SHUTDOWN",
    -1,
    _ADMIN + " no_multi allow_busy",
    group="server",
    summary="Shuts the server down gracefully: in-flight commands finish, chunks held only in "
    "memory (DRAM, GPU) are written to NVMe (not with NOSAVE; within shutdown-timeout), tiers "
    "are closed.",
    complexity="O(N) where N is the number of chunks held only in memory (none with NOSAVE)",
    arguments=(
        Arg(
            "save-selector",
            "oneof",
            optional=True,
            arguments=(
                Arg("nosave", "pure-token", token="NOSAVE"),
                Arg("save", "pure-token", token="SAVE"),
            ),
        ),
        Arg("now", "pure-token", optional=True, token="NOW"),
        Arg("force", "pure-token", optional=True, token="FORCE"),
        Arg("abort", "pure-token", optional=True, token="ABORT"),
    ),
    reply="Nothing on success: the connection closes. An error with ABORT.",
)
def shutdown(ctx: Ctx, args: Args) -> Reply:
    opts = {arg_upper(a) for a in args[1:]}
    if not opts <= _SHUTDOWN_OPTS:
        raise syntax_error()
    if (b"ABORT" in opts and len(opts) > 1) or {b"SAVE", b"NOSAVE"} <= opts:
        raise syntax_error()
    if b"ABORT" in opts:
        raise CommandError("No shutdown in progress.")  # shutdowns here are never pending
    ctx.server.request_shutdown(save=b"NOSAVE" not in opts)
    ctx.close_after_reply()
    return NO_REPLY
