"""The vLLM tier's lookups (:mod:`kvstrata.clients.vllm`): the per-request state and the step's
``KV.MATCH`` round trip.

A mixin of :class:`~kvstrata.clients.vllm.KvstrataTier`. ``lookup`` answers at once from what a
request already learnt or from the recent-hit cache (:mod:`kvstrata.clients.vllm_lookup`), else
queues the key and answers ``RETRY``. ``on_schedule_end`` sends every queued chain of the step
in one pipelined write on the tier's own lookup connection, from the scheduler's thread, and
does not wait; the lookups that follow (at most every :data:`POLL_EVERY_S`) and the next
``on_schedule_end`` read the replies once they are there (``SyncConnection.receive_ready``:
never a wait) and apply the verdicts (and the keys a load found missing). No thread hand-off
on the way: that cost more than the ``KV.MATCH`` itself (issue 31). The lookup connection is
made on the tier's lookup thread (a connect may wait on a dead server); while it is not up, or
after it failed, the step's chains go to that thread as before, which connects it again.

What a reply means is exact either way: the leading ``n`` keys of a chain are stored (and
remembered), the rest miss (and are forgotten); an error reply, a lost connection or no reply
within the tier's ``timeout_s`` is a miss of every key in flight, never a hit.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)

from kvstrata.clients.connection import ConnectionSettings, SyncConnection
from kvstrata.clients.vllm_io import ChunkMover
from kvstrata.clients.vllm_lookup import RecentHits, group_chains

__all__ = ["POLL_EVERY_S", "RequestLookups", "RequestState"]

_HIT, _MISS, _RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
#: a lookup looks for the replies of the step's KV.MATCH es at most this often (one poll
#: costs a system call; a 500-key scan takes longer than this)
POLL_EVERY_S = 25e-6
Chains = list[tuple[str, list[bytes]]]  # (request id, one KV group's chain)


def _positions(ctx: ReqContext | None, keys: list[bytes]) -> Mapping[bytes, int]:
    """key → end token, as the scheduler recorded them in ``ctx``: vLLM's own dict when it
    has one (0.32, 0.33: read in C, no call per key), else asked key by key."""
    if ctx is None:
        return {}
    table = getattr(ctx, "_offload_key_positions", None)
    if isinstance(table, dict):
        return table
    return {k: end for k in keys if (end := ctx.get_offload_key_position(k)) is not None}


@dataclass(slots=True)
class RequestState:
    """Lookup state of one request: verdicts so far, keys asked and not answered yet
    (``pending``; ``unsent``: not in a ``KV.MATCH`` yet, in the order asked), and the chain
    (group, end token) → key for the parents of stored chunks. Keys join the chain only when
    a store needs parents (``unlinked``: looked up, not in the chain yet), so a lookup does no
    more per key than it must."""

    verdicts: dict[bytes, bool] = field(default_factory=dict)
    pending: set[bytes] = field(default_factory=set)
    unsent: list[bytes] = field(default_factory=list)
    in_flight: bool = False
    ctx: ReqContext | None = None  # the request's context (the scheduler reuses one)
    chain: dict[tuple[bytes, int], bytes] = field(default_factory=dict)
    unlinked: list[bytes] = field(default_factory=list)


@dataclass(slots=True)
class _Sent:
    """One step's ``KV.MATCH`` es on the lookup connection whose replies are not read yet."""

    chains: Chains
    at: float  # time.monotonic() when sent


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
    _hit_until: Callable[[bytes], float | None]
    _refused: str | None
    _timeout_s: float
    _lookup_settings: ConnectionSettings
    _lookup_conn: SyncConnection | None  # the scheduler's, for KV.MATCH only
    _connecting: bool
    _sent: deque[_Sent]
    _next_poll: float

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
        if self._sent and time.monotonic() >= self._next_poll:
            self._poll()
        if self._matches or self._misses:
            self._apply_matches()
        state = self._requests.get(req_context.req_id)
        if state is None:
            state = self._requests[req_context.req_id] = RequestState()
        verdict = state.verdicts.get(key)
        if verdict is not None:
            return _HIT if verdict else _MISS
        if key in state.pending:  # asked already, its KV.MATCH not answered yet
            return _RETRY
        until = self._hit_until(key)  # stored or matched lately (RecentHits.hit, inlined)
        if until is not None and (until > time.monotonic() or self._hit(key)):
            state.verdicts[key] = True
            state.unlinked.append(key)  # (a later store's parent may be this key)
            return _HIT
        state.pending.add(key)
        state.unsent.append(key)
        state.ctx = req_context
        return _RETRY

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        if self._sent:
            self._poll()
        self._apply_matches()
        chains: Chains = []
        for req_id, state in self._requests.items():
            if state.unsent and not state.in_flight:
                keys, state.unsent = state.unsent, []
                state.in_flight = True
                state.unlinked += keys
                positions = _positions(state.ctx, keys)
                chains += [(req_id, chain) for chain in group_chains(keys, positions)]
        if chains and not self._send(chains):  # not connected: the lookup thread's way
            future = self._lookups.submit(self._match, chains)
            self._matching.add(future)
            future.add_done_callback(self._matching.discard)

    def _link(self, state: RequestState, ctx: ReqContext) -> None:
        """Record the chain positions of the keys this request looked up (a store's parents)."""
        for key in state.unlinked:
            self._remember(state, key, ctx)
        state.unlinked.clear()

    # -- the scheduler's own lookup connection ---------------------------------------------

    def _send(self, chains: Chains) -> bool:
        """One pipelined ``KV.MATCH`` per chain on the lookup connection, not waiting for the
        replies; False when it is not up (the lookup thread is asked to connect it)."""
        conn = self._lookup_conn
        if conn is None or conn.closed:
            self._connect_lookups_later()
            return False
        try:
            conn.send([("KV.MATCH", self.namespace, *chain) for _, chain in chains])
        except Exception as exc:  # lost: what was in flight misses, these go the thread's way
            self._lookups_lost(exc)
            return False
        now = time.monotonic()
        self._sent.append(_Sent(chains, now))
        self._next_poll = now + POLL_EVERY_S
        return True

    def _poll(self) -> None:
        """Apply the replies that have arrived, oldest step first; never waits."""
        now = time.monotonic()
        while self._sent:
            batch, conn = self._sent[0], self._lookup_conn
            try:
                if conn is None:
                    raise ConnectionError("the lookup connection is closed")
                replies = conn.receive_ready(len(batch.chains))
                if replies is None and now - batch.at > self._timeout_s:
                    raise TimeoutError(f"no KV.MATCH reply in {self._timeout_s:g} s")
            except Exception as exc:
                self._lookups_lost(exc)
                return
            if replies is None:
                self._next_poll = now + POLL_EVERY_S
                return
            self._sent.popleft()
            self._matches.extend(self._verdicts(batch.chains, replies))

    def _lookups_lost(self, exc: BaseException) -> None:
        """The lookup connection failed: every key in flight on it misses, nothing is known
        any more (the server may have restarted), and the lookup thread reconnects."""
        self._log_failure("KV.MATCH", exc)
        conn, self._lookup_conn = self._lookup_conn, None
        if conn is not None:
            conn.close()
        self._hits.clear()
        while self._sent:
            self._matches.extend(self._all_miss(self._sent.popleft().chains).items())
        self._connect_lookups_later()

    def _connect_lookups_later(self) -> None:
        if not self._connecting:
            self._connecting = True
            try:
                self._lookups.submit(self._connect_lookups)
            except RuntimeError:  # shut down
                self._connecting = False

    def _connect_lookups(self) -> None:
        """(the lookup thread) Open the scheduler's lookup connection."""
        try:
            if self._lookup_conn is None or self._lookup_conn.closed:
                self._lookup_conn = SyncConnection(self._lookup_settings)
        except Exception as exc:  # the server is down: the next step asks again
            self._log_failure("lookup connect", exc)
        finally:
            self._connecting = False

    def _close_lookups(self) -> None:
        """(shutdown) Close the lookup connection; replies still due will never be read."""
        self._sent.clear()
        conn, self._lookup_conn = self._lookup_conn, None
        if conn is not None:
            conn.close()

    # -- verdicts ---------------------------------------------------------------------------

    def _verdicts(self, chains: Chains, counts: list[Any]) -> list[tuple[str, dict[bytes, bool]]]:
        """Per request, each key's verdict from the ``KV.MATCH`` reply of its chain: the
        leading ``n`` keys hit (remembered), the rest miss (forgotten); an error reply (or
        anything but a count) misses the whole chain."""
        verdicts: dict[str, dict[bytes, bool]] = {}
        for (req_id, chain), n in zip(chains, counts, strict=True):
            if type(n) is not int or not 0 <= n <= len(chain):
                self._log_failure("KV.MATCH", ValueError(f"reply {n!r}"))
                n = 0
            # (dicts made from dicts are sized at once: each key is hashed into a dict once)
            got = dict.fromkeys(chain[:n], True)
            self._hits.add(got)
            if n < len(chain):
                missed = dict.fromkeys(chain[n:], False)
                self._hits.forget(missed)
                got.update(missed)
            if req_id in verdicts:  # another KV group's chain of the same request
                verdicts[req_id].update(got)
            else:
                verdicts[req_id] = got
        return list(verdicts.items())

    @staticmethod
    def _all_miss(chains: Chains) -> dict[str, dict[bytes, bool]]:
        verdicts: dict[str, dict[bytes, bool]] = {}
        for req_id, chain in chains:
            verdicts.setdefault(req_id, {}).update(dict.fromkeys(chain, False))
        return verdicts

    def _match(self, chains: Chains) -> None:
        """(the lookup thread, while the lookup connection is not up) The chains' pipelined
        ``KV.MATCH`` es on the mover's client (its pool reconnects by itself)."""
        try:
            with self._mover.client().pipeline() as p:
                for _, chain in chains:
                    p.match(self.namespace, chain)
                counts = p.execute(raise_on_error=False)
            self._matches.extend(self._verdicts(chains, counts))
        except Exception as exc:  # server down, timeout: a miss, never an error in vLLM
            self._log_failure("KV.MATCH", exc)
            self._hits.clear()
            self._matches.extend(self._all_miss(chains).items())

    def _apply_matches(self) -> None:
        while self._matches:
            req_id, verdicts = self._matches.popleft()
            state = self._requests.get(req_id)
            if state is not None:
                if state.verdicts:
                    state.verdicts.update(verdicts)
                else:  # (the common case, and no copy: the dict is this request's alone)
                    state.verdicts = verdicts
                state.in_flight = False
                # pending: what was in flight (answered now) and what was asked since
                state.pending = set(state.unsent)
        while self._misses:
            req_id, keys = self._misses.popleft()
            self._hits.forget(keys)
            state = self._requests.get(req_id)
            if state is not None:
                state.verdicts.update(dict.fromkeys(keys, False))
