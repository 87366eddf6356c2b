"""A fake server and connection context for calling command handlers directly.

``FakeCtx.call("SET", "k", "v")`` resolves the command the way the real dispatcher does
(subcommands, arity, NOAUTH) and runs the handler; errors are raised as ``RespError``.
:func:`err` returns the error line a client would see.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from kvstrata.config import Config, load_config
from kvstrata.protocol.errors import CommandError, NoAuthError, RespError, wrong_arity
from kvstrata.server.cmdstats import CommandStats
from kvstrata.server.context import ClientState, ServerStats
from kvstrata.server.registry import CommandSpec, CommandTable, load_all
from kvstrata.server.slowlog import SlowLog
from kvstrata.store.keyspace import Keyspace
from kvstrata.store.strings import StringStore

_ids = itertools.count(1)


class FakeStore:
    """Only what INFO reads from the store."""

    def info_sections(self) -> dict[str, list[tuple[str, object]]]:
        return {"tiers": [("dram", {"capacity": 64, "used": 0})], "persistence": [("loading", 0)]}


class FakeServer:
    def __init__(self, **flags: Any) -> None:
        self.config: Config = load_config(
            flags={k.replace("_", "-"): v for k, v in flags.items()}, env={}
        )
        self.config_file = ""
        self.keyspace = Keyspace()
        self.strings = StringStore(self.keyspace, self.config)
        self.store: Any = None
        self.registry: CommandTable = load_all()
        self.clients: dict[int, FakeCtx] = {}
        self.stats = ServerStats()
        self.cmdstats = CommandStats()
        self.slowlog = SlowLog(self.config)
        self.monitors: set[FakeCtx] = set()
        self.start_time = time.time() - 90000
        self.run_id = "ab" * 20
        self.port = 7379
        self.shutdown_requested = False
        self.shutdown_save = True
        self.loading = False
        self.loading_start_time = 0.0
        self.tracer: Any = None  # serve --trace-file (kvstrata.server.trace.TraceRecorder)

    def request_shutdown(self, save: bool = True) -> None:
        self.shutdown_requested = True
        self.shutdown_save = save

    def used_memory(self) -> int:
        return 3 * 1024 * 1024

    def connect(self, addr: str = "") -> FakeCtx:
        return FakeCtx(self, addr)


class FakeCtx:
    def __init__(self, server: FakeServer, addr: str = "") -> None:
        cid = next(_ids)
        self.server = server
        self.client = ClientState(
            id=cid, addr=addr or f"127.0.0.1:{40000 + cid}", laddr="127.0.0.1:7379"
        )
        self.client.authenticated = not server.config.get("requirepass")
        self.sinks: dict[int, Any] = {}
        self.closing_after_reply = False
        self.killed = False
        self.pushes: list[Any] = []
        server.clients[cid] = self

    # -- Ctx ----------------------------------------------------------------------------
    def close_after_reply(self) -> None:
        self.closing_after_reply = True

    def kill(self) -> None:
        self.killed = True
        self.server.clients.pop(self.client.id, None)

    def set_protocol(self, version: int) -> None:
        self.client.protocol = version

    def start_monitor(self) -> None:
        self.client.flags.add("O")
        self.server.monitors.add(self)

    def stop_monitor(self) -> None:
        self.client.flags.discard("O")
        self.server.monitors.discard(self)

    def send_push(self, value: Any) -> None:
        self.pushes.append(value)

    # -- test helpers -------------------------------------------------------------------
    def resolve(self, args: list[Any]) -> CommandSpec:
        spec = self.server.registry.lookup(bytes(args[0]).lower())
        if spec is None:
            raise CommandError(f"unknown command '{bytes(args[0]).decode()}'")
        if spec.subcommands and (len(args) > 1 or spec.handler is None):
            from kvstrata.server.commands.connection import unknown_subcommand

            if len(args) < 2:
                raise wrong_arity(spec.name)
            sub = spec.subcommands.get(bytes(args[1]).upper().decode())
            if sub is None:
                raise unknown_subcommand(spec.name, args[1])
            spec = sub
        arity = spec.arity
        if (arity > 0 and len(args) != arity) or len(args) < -arity:
            raise wrong_arity(spec.name.replace("|", " "))
        if not self.client.authenticated and "no_auth" not in spec.flags:
            raise NoAuthError("Authentication required.")
        return spec

    def call(self, *words: Any) -> Any:
        args = [w.encode() if isinstance(w, str) else w for w in words]
        spec = self.resolve(args)
        assert spec.handler is not None
        return spec.handler(self, args)


def err(ctx: FakeCtx, *words: Any) -> str:
    """The error line (``ERR ...``) a command answers with; fails when it does not fail."""
    try:
        reply = ctx.call(*words)
    except RespError as exc:
        return exc.reply_line().decode()
    raise AssertionError(f"{words!r} did not fail: {reply!r}")
