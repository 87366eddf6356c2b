"""Pipelines: queue typed commands, send them in one write, decode the replies in order.

The queueing methods (one per ``KV.*`` command, each returning the pipeline so calls chain)
are shared by the sync and the async pipeline; only ``execute`` differs. Lease and reserve
results come back as plain grants (:class:`~kvstrata.clients.results.LeaseGrant`,
:class:`~kvstrata.clients.results.ReserveGrant`), not context managers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, Self, TypeVar

from kvstrata.clients import commands as cmd
from kvstrata.clients.commands import Call
from kvstrata.protocol.errors import RespError

__all__ = ["PipelineBase"]

P = ParamSpec("P")
PB = TypeVar("PB", bound="PipelineBase")


def _queued(build: Callable[P, Call[Any]]) -> Callable[Concatenate[PB, P], PB]:
    """A pipeline method that queues the command ``build`` makes and returns the pipeline."""

    def method(self: PB, /, *args: P.args, **kwargs: P.kwargs) -> PB:
        return self._add(build(*args, **kwargs))

    return cmd.method_like(build, method)


class PipelineBase:
    def __init__(self) -> None:
        self._calls: list[Call[Any]] = []

    def __len__(self) -> int:
        return len(self._calls)

    def _add(self, call: Call[Any]) -> Self:
        self._calls.append(call)
        return self

    def _take(self) -> list[Call[Any]]:
        """The queued calls, leaving the pipeline empty."""
        calls, self._calls = self._calls, []
        return calls

    @staticmethod
    def _decode(calls: list[Call[Any]], replies: list[Any], raise_on_error: bool) -> list[Any]:
        results: list[Any] = []
        for call, reply in zip(calls, replies, strict=True):
            keep_error = isinstance(reply, RespError) and not raise_on_error
            results.append(reply if keep_error else call.result(reply))
        return results

    def execute_command(self, *args: Any, out: Any = None) -> Self:
        return self._add(cmd.raw(args, out))

    ping = _queued(cmd.ping)
    put = _queued(cmd.put)
    get = _queued(cmd.get)
    mget = _queued(cmd.mget)
    match = _queued(cmd.match)
    match_tiers = _queued(cmd.match_tiers)
    match_tokens = _queued(cmd.match_tokens)
    lease = _queued(cmd.lease)
    reserve = _queued(cmd.reserve)
    mreserve = _queued(cmd.mreserve)
    commit = _queued(cmd.commit)
    abort = _queued(cmd.abort)
    release = _queued(cmd.release)
    regions = _queued(cmd.regions)
    info = _queued(cmd.info)
    delete = _queued(cmd.delete)
    stats = _queued(cmd.stats)
