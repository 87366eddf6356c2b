"""The connection's dispatch: resolve a command, run its handler, record it, queue its reply.

A mixin of ``Connection`` (as ``FastRead`` and ``WriteSide``): :meth:`Dispatch._execute` runs one
decoded command in pipeline order. It resolves the command's spec (subcommands, arity, and as
Redis ``NOAUTH`` before AUTH and ``LOADING`` while the store loads), feeds ``MONITOR``, calls the
handler, and records the call in ``INFO commandstats`` and the slow log. A handler that returns
a coroutine (an ``async def``, or a sync handler on its slow path) runs as a task and the
commands behind it wait (:meth:`Dispatch._finish_async` replies and resumes the connection).
"""

from __future__ import annotations

import asyncio
import logging
from time import perf_counter
from types import CoroutineType
from typing import TYPE_CHECKING, Any, cast

from kvstrata.protocol.encoder import encode_reply
from kvstrata.protocol.errors import (
    CommandError,
    LoadingError,
    NoAuthError,
    RespError,
    wrong_arity,
)
from kvstrata.protocol.frames import Simple
from kvstrata.server.context import ClientState
from kvstrata.server.pins import release_now

if TYPE_CHECKING:
    from kvstrata.server.app import Server
    from kvstrata.server.connection import Connection
    from kvstrata.server.registry import CommandSpec

log = logging.getLogger("kvstrata.server")

_NO_SINKS: dict[int, Any] = {}
#: as Redis: AUTH/HELLO and admin commands (CONFIG SET requirepass …) are not shown to MONITOR
_NOT_MONITORED = frozenset({"no_auth", "admin"})


class Dispatch:
    """Mixin of ``Connection``: one command from its arguments to its queued reply."""

    # state owned by Connection
    server: Server
    client: ClientState
    sinks: dict[int, Any]
    _out: list[Any]
    _busy: bool
    _closing: bool
    _resp3: bool
    _slow: float
    _task: asyncio.Task[None] | None

    if TYPE_CHECKING:  # Connection's (a stub here would shadow them)

        def _authenticated(self) -> bool: ...
        def _abort_sinks(self, sinks: dict[int, Any]) -> None: ...
        def _reply(self, value: Any) -> None: ...
        def _reply_error(self, exc: RespError) -> None: ...
        def _process(self, declined: int = -1) -> None: ...
        def kill(self) -> None: ...

    def _execute(self, args: list[Any], sinks: dict[int, Any]) -> None:
        """Run one command and queue its reply. This is the hot path: keep it lean."""
        server = self.server
        try:
            spec = server.fast_specs.get(args[0])
        except (TypeError, ValueError):  # a name that arrived as a large bulk (unhashable)
            spec = None
        if (
            spec is None
            or (spec.arity > 0 and len(args) != spec.arity)
            or len(args) < -spec.arity
            or not self.client.authenticated
            or server.loading
        ):
            try:
                spec = self._resolve(server.registry.lookup(args[0]), args)
            except RespError as exc:
                self._abort_sinks(sinks)
                server.cmdstats.reject_args(server.registry, args)
                self._reply_error(exc)
                return
        if server.monitors and not spec.flags & _NOT_MONITORED:
            server.feed_monitors(cast("Connection", self), args)
        self.client.last_command = spec.name
        self.sinks = sinks
        started = perf_counter()
        try:
            result = spec.handler(self, args)  # type: ignore[misc]
        except RespError as exc:
            result = exc
        except Exception as exc:  # a bug must not kill the connection
            result = self._internal_error(spec, exc)
        # A sync handler may return a coroutine when it needs I/O only sometimes (KV.MATCH
        # asking S3 about the part of a chain not held locally): it then runs like an async one.
        if spec.is_async or type(result) is CoroutineType:
            self._busy = True
            self._task = asyncio.ensure_future(self._finish_async(result, spec, args, started))
            return
        if sinks:
            self.sinks = _NO_SINKS
            self._abort_sinks(sinks)
        elapsed = perf_counter() - started
        server.cmdstats.record(spec.name, elapsed, isinstance(result, RespError))
        t = type(result)
        if t is bytes or t is Simple or t is int or result is None:
            encode_reply(result, self._resp3, self._out)
        else:
            self._reply(result)
        if elapsed > self._slow:
            server.slowlog_record(started, args, self.client)

    def _internal_error(self, spec: CommandSpec, exc: Exception) -> CommandError:
        log.exception("command %s failed", spec.name)
        self.server.stats.unexpected_errors += 1
        return CommandError(f"internal error in '{spec.wire_name}': {exc}")

    def _resolve(self, spec: CommandSpec | None, args: list[Any]) -> CommandSpec:
        if spec is None:
            raise _unknown_command(args)
        if spec.subcommands and (len(args) >= 2 or spec.handler is None):
            if len(args) < 2:
                raise wrong_arity(spec.name)
            sub = spec.subcommands.get(bytes(args[1]).upper().decode("utf-8", "replace"))
            if sub is None:
                raise CommandError(f"unknown subcommand '{_trunc(args[1])}'. Try {spec.name} HELP.")
            spec = sub
        arity = spec.arity
        if (arity > 0 and len(args) != arity) or len(args) < -arity:
            raise CommandError(f"wrong number of arguments for '{spec.name.lower()}' command")
        if not self._authenticated() and "no_auth" not in spec.flags:
            raise NoAuthError("Authentication required.")
        if self.server.loading and "loading" not in spec.flags:
            raise LoadingError()  # as Redis: only commands flagged `loading` run meanwhile
        return spec

    async def _finish_async(
        self, coro: Any, spec: CommandSpec, args: list[Any], started: float
    ) -> None:
        sinks = self.sinks
        try:
            result = await coro if asyncio.iscoroutine(coro) else coro
        except RespError as exc:
            result = exc
        except Exception as exc:
            result = self._internal_error(spec, exc)
        finally:
            self.sinks = _NO_SINKS
            if sinks:
                self._abort_sinks(sinks)
        self._busy = False
        self._task = None
        self.server.cmdstats.record(
            spec.name, perf_counter() - started, isinstance(result, RespError)
        )
        if self._closing:
            release_now(result)
            return
        try:
            self._reply(result)
            if perf_counter() - started > self.server.slowlog_threshold:
                self.server.slowlog_record(started, args, self.client)
            self._process()
        except Exception:  # a bug here must not leave the connection silently stuck
            log.exception("connection %s failed after %s", self.client.addr, spec.name)
            self.server.stats.unexpected_errors += 1
            self.kill()


def _trunc(arg: Any, limit: int = 128) -> str:
    return bytes(arg[:limit]).decode("utf-8", "replace")


def _unknown_command(args: list[Any]) -> CommandError:
    rest = " ".join(f"'{_trunc(a)}'" for a in args[1:8])
    return CommandError(
        f"unknown command '{_trunc(args[0])}', with args beginning with: {rest}".rstrip()
        + (" " if rest else "")
    )
