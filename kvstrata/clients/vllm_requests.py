"""The vLLM tier's lookups (:mod:`kvstrata.clients.vllm`): the per-request state and the step's
``KV.MATCH`` round trip.

A mixin of :class:`~kvstrata.clients.vllm.KvstrataTier`. ``lookup`` answers at once from what a
request already learnt or from the recent-hit cache (:mod:`kvstrata.clients.vllm_lookup`), else
queues the key and answers ``RETRY``; ``on_schedule_end`` sends every queued chain of the step
in one pipelined round trip on the tier's lookup thread, and the next lookup applies the
verdicts (and the keys a load found missing).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)

from kvstrata.clients.vllm_io import ChunkMover
from kvstrata.clients.vllm_lookup import RecentHits, group_chains

__all__ = ["RequestLookups", "RequestState"]

_HIT, _MISS = LookupResult.HIT, LookupResult.MISS


@dataclass(slots=True)
class RequestState:
    """Lookup state of one request: verdicts so far, keys queued for the next ``KV.MATCH``,
    and the chain (group, end token) → key for the parents of stored chunks (keys answered
    from the recent-hit cache join it only when a store needs parents: ``cached``)."""

    verdicts: dict[bytes, bool] = field(default_factory=dict)
    queued: dict[bytes, None] = field(default_factory=dict)
    in_flight: bool = False
    chain: dict[tuple[bytes, int], bytes] = field(default_factory=dict)
    cached: list[bytes] = field(default_factory=list)


class RequestLookups:
    """Mixin of ``KvstrataTier``: its per-request state and lookups."""

    # state owned by KvstrataTier
    namespace: str
    _mover: ChunkMover
    _lookups: ThreadPoolExecutor
    _requests: dict[str, RequestState]
    _matches: deque[tuple[str, dict[bytes, bool]]]
    _misses: deque[tuple[str, list[bytes]]]
    _matching: set[Future[None]]
    _hits: RecentHits
    _hit: Callable[[bytes], bool]
    _refused: str | None

    if TYPE_CHECKING:  # KvstrataTier's (a stub here would shadow it)

        def _check_shareable(self) -> bool: ...
        def _log_failure(self, what: str, exc: BaseException) -> None: ...

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._requests.setdefault(req_context.req_id, RequestState())
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._requests.pop(req_context.req_id, None)

    def _remember(self, state: RequestState, key: bytes, ctx: ReqContext) -> int | None:
        end = ctx.get_offload_key_position(key)
        if end is not None:
            state.chain[(key[-4:], end)] = key
        return end

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        # called for every key of every waiting request on the scheduler's path: kept lean
        if self._refused != "" and not self._check_shareable():
            return _MISS
        if self._matches or self._misses:
            self._apply_matches()
        state = self._requests.get(req_context.req_id)
        if state is None:
            state = self._requests[req_context.req_id] = RequestState()
        verdict = state.verdicts.get(key)
        if verdict is not None:
            return _HIT if verdict else _MISS
        if self._hit(key):  # stored or matched a moment ago: no round trip
            state.verdicts[key] = True
            state.cached.append(key)  # (a later store's parent may be this key)
            return _HIT
        self._remember(state, key, req_context)
        state.queued[key] = None
        return LookupResult.RETRY

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._apply_matches()
        step: list[tuple[str, list[list[bytes]]]] = []
        for req_id, state in self._requests.items():
            if state.queued and not state.in_flight:
                keys, state.queued = list(state.queued), {}
                state.in_flight = True
                step.append((req_id, group_chains(keys, state.chain)))
        if step:  # the whole step's lookups in one round trip
            future = self._lookups.submit(self._match, step)
            self._matching.add(future)
            future.add_done_callback(self._matching.discard)

    def _match(self, step: list[tuple[str, list[list[bytes]]]]) -> None:
        """One pipelined ``KV.MATCH`` per request and group chain: the leading ``n`` keys of a
        chain hit (remembered), the rest miss (forgotten)."""
        chains = [(req_id, chain) for req_id, group in step for chain in group]
        verdicts: dict[str, dict[bytes, bool]] = {req_id: {} for req_id, _ in step}
        try:
            with self._mover.client().pipeline() as p:
                for _, chain in chains:
                    p.match(self.namespace, chain)
                counts = p.execute()
            for (req_id, chain), n in zip(chains, counts, strict=True):
                verdicts[req_id].update((k, i < n) for i, k in enumerate(chain))
                self._hits.add(chain[:n])
                self._hits.forget(chain[n:])
        except Exception as exc:  # server down, timeout: a miss, never an error in vLLM
            self._log_failure("KV.MATCH", exc)
            self._hits.clear()
            for req_id, chain in chains:
                got = verdicts[req_id]
                got.update((k, False) for k in chain if k not in got)
        self._matches.extend(verdicts.items())

    def _apply_matches(self) -> None:
        while self._matches:
            req_id, verdicts = self._matches.popleft()
            state = self._requests.get(req_id)
            if state is not None:
                state.verdicts.update(verdicts)
                state.in_flight = False
                for key in verdicts:  # asked again while in flight: answered now
                    state.queued.pop(key, None)
        while self._misses:
            req_id, keys = self._misses.popleft()
            self._hits.forget(keys)
            state = self._requests.get(req_id)
            if state is not None:
                state.verdicts.update(dict.fromkeys(keys, False))
