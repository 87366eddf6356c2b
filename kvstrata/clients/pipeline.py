"""Pipelines: queue typed commands, send them in one write, decode the replies in order.

The queueing methods (one per ``KV.*`` command, each returning the pipeline so calls chain)
are shared by the sync and the async pipeline; only ``execute`` differs. Lease and reserve
results come back as plain grants (:class:`~kvstrata.clients.results.LeaseGrant`,
:class:`~kvstrata.clients.results.ReserveGrant`), not context managers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Self

from kvstrata.clients import commands as cmd
from kvstrata.clients.commands import Call, HashLike, Payload
from kvstrata.clients.results import LeaseId
from kvstrata.protocol.errors import RespError
from kvstrata.store.hashing import TokenInput

__all__ = ["PipelineBase"]


class PipelineBase:
    def __init__(self) -> None:
        self._calls: list[Call[Any]] = []

    def __len__(self) -> int:
        return len(self._calls)

    def _add(self, call: Call[Any]) -> Self:
        self._calls.append(call)
        return self

    @staticmethod
    def _decode(calls: list[Call[Any]], replies: list[Any], raise_on_error: bool) -> list[Any]:
        results: list[Any] = []
        for call, reply in zip(calls, replies, strict=True):
            if isinstance(reply, RespError):
                if raise_on_error:
                    raise reply
                results.append(reply)
            else:
                results.append(call.decode(reply))
        return results

    def execute_command(self, *args: Any, out: Any = None) -> Self:
        return self._add(cmd.raw(args, out))

    def ping(self) -> Self:
        return self._add(cmd.ping())

    def put(
        self,
        ns: str,
        hash: HashLike,
        parent: HashLike | None,
        payload: Payload,
        tokens: int = 0,
        ttl_ms: int | None = None,
        nx: bool = False,
    ) -> Self:
        return self._add(cmd.put(ns, hash, parent, payload, tokens, ttl_ms, nx))

    def get(self, ns: str, hash: HashLike, out: Any = None) -> Self:
        return self._add(cmd.get(ns, hash, out))

    def mget(self, ns: str, hashes: Sequence[HashLike], outs: Sequence[Any] | None = None) -> Self:
        return self._add(cmd.mget(ns, hashes, outs))

    def match(self, ns: str, hashes: Sequence[HashLike], prefetch: bool = False) -> Self:
        return self._add(cmd.match(ns, hashes, prefetch))

    def match_tiers(self, ns: str, hashes: Sequence[HashLike], prefetch: bool = False) -> Self:
        return self._add(cmd.match_tiers(ns, hashes, prefetch))

    def match_tokens(
        self,
        ns: str,
        tokens: TokenInput,
        chunk_tokens: int | None = None,
        extra: Sequence[bytes | str] = (),
    ) -> Self:
        return self._add(cmd.match_tokens(ns, tokens, chunk_tokens, extra))

    def lease(self, ns: str, hashes: Sequence[HashLike], ttl_ms: int | None = None) -> Self:
        return self._add(cmd.lease(ns, hashes, ttl_ms))

    def reserve(
        self,
        ns: str,
        hash: HashLike,
        parent: HashLike | None,
        nbytes: int,
        tokens: int = 0,
        ttl_ms: int | None = None,
    ) -> Self:
        return self._add(cmd.reserve(ns, hash, parent, nbytes, tokens, ttl_ms))

    def commit(self, lease_id: LeaseId) -> Self:
        return self._add(cmd.commit(lease_id))

    def abort(self, lease_id: LeaseId) -> Self:
        return self._add(cmd.abort(lease_id))

    def release(self, lease_id: LeaseId) -> Self:
        return self._add(cmd.release(lease_id))

    def regions(self) -> Self:
        return self._add(cmd.regions())

    def info(self, ns: str, hash: HashLike) -> Self:
        return self._add(cmd.info(ns, hash))

    def delete(self, ns: str, hash: HashLike, cascade: bool = False) -> Self:
        return self._add(cmd.delete(ns, hash, cascade))

    def stats(self) -> Self:
        return self._add(cmd.stats())
