"""A workload generator: multi-turn chats with think times, agent loops, shared system prompts
and tool schemas, RAG documents with Zipf popularity.

Every session starts at a Poisson arrival, picks a system prompt (and tool schema, for agents)
and ``docs_per_session`` RAG documents (Zipf-popular), then runs its turns: each turn's prompt
is system prompt + tools + documents + the conversation so far + the new message, cut into
``chunk_tokens`` chunks whose chained hashes name their whole prefix (so shared prefixes match
across sessions exactly as in the server). Between turns the session thinks (exponential, mean
``chat_think`` / ``agent_think`` seconds); with ``prefetch_lead`` > 0 a ``KV.PREFETCH … SESSION``
is issued that many seconds before the next turn (a user typing, a tool call returning).

The generator yields :class:`Request`\\ s (and prefetch hints) in time order; :func:`drive`
plays one through a simulator the way an engine drives the server: MATCH the chain, GET the
matched prefix, PUT the rest, record the SESSION tail.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import itertools
import random
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class Workload:
    """Parameters (TOML table ``[workload]`` or ``--set key=value``)."""

    seed: int = 1
    namespace: str = "sim"
    duration: float = 600.0  # seconds during which sessions start
    sessions_per_second: float = 1.0
    chunk_tokens: int = 256
    chunk_bytes: int = 0  # 0: the model's KV size of one chunk
    agent_fraction: float = 0.3
    chat_turns: float = 6.0  # mean (geometric)
    chat_think: float = 30.0  # seconds, mean (exponential); the seeds' 30-second pause
    chat_user_tokens: int = 150
    chat_reply_tokens: int = 400
    agent_turns: float = 20.0
    agent_think: float = 3.0
    agent_step_tokens: int = 600  # tool output + model step appended per turn
    system_prompts: int = 4
    system_tokens: int = 2000
    tool_schemas: int = 2
    tool_tokens: int = 3000
    rag_docs: int = 1000
    doc_tokens: int = 2000
    docs_per_session: int = 1
    zipf: float = 1.1
    prefetch_lead: float = 0.0  # seconds before a turn to prefetch the session; 0: off
    prefetch_deadline: float = 0.0  # seconds a prefetch may take (KV.PREFETCH DEADLINE); 0: none


def load_workload(path: str | Path | None, overrides: Mapping[str, str]) -> Workload:
    """A :class:`Workload` from a TOML file's ``[workload]`` table and ``key=value`` overrides
    (dashes or underscores); ValueError names an unknown key or a bad value."""
    values: dict[str, Any] = {}
    if path is not None:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
        table = doc.get("workload", doc)
        if not isinstance(table, dict):
            raise ValueError(f"{path}: [workload] must be a table")
        values.update(table)
    values.update(overrides)
    types = {f.name: f.type for f in fields(Workload)}
    kw: dict[str, Any] = {}
    for key, raw in values.items():
        name = key.replace("-", "_")
        if name not in types:
            raise ValueError(f"unknown workload key '{key}' (keys: {', '.join(types)})")
        cast = {"int": int, "float": float, "str": str}[str(types[name])]
        try:
            kw[name] = cast(raw)
        except (TypeError, ValueError):
            raise ValueError(f"invalid value for workload key '{key}': {raw!r}") from None
    wl = replace(Workload(), **kw)
    if wl.chunk_tokens <= 0 or wl.duration < 0 or wl.sessions_per_second <= 0:
        raise ValueError("chunk_tokens and sessions_per_second must be > 0, duration >= 0")
    return wl


@dataclass(frozen=True, slots=True)
class Request:
    """One turn: the chain (root first) and its parents; ``tokens`` of the whole prompt."""

    t: float
    session: bytes
    hashes: tuple[bytes, ...]
    tokens: int


@dataclass(frozen=True, slots=True)
class Prefetch:
    t: float
    session: bytes


def _chain(parts: list[tuple[str, int, int]], ct: int) -> list[bytes]:
    """Chained hashes of the full chunks of ``parts`` ((kind, id, tokens) segments): a chunk
    is named by the segment ranges it covers, chained to its parent's hash."""
    out: list[bytes] = []
    h = b""
    total = sum(n for _, _, n in parts)
    seg, seg_start = 0, 0  # current segment and its first token's position
    for k in range(total // ct):
        lo, hi = k * ct, (k + 1) * ct
        name = []
        while seg < len(parts) and seg_start + parts[seg][2] <= lo:
            seg_start += parts[seg][2]
            seg += 1
        i, start = seg, seg_start
        while i < len(parts) and start < hi:
            kind, ident, n = parts[i]
            name.append(f"{kind}{ident}[{max(lo, start) - start}:{min(hi, start + n) - start}]")
            start += n
            i += 1
        h = hashlib.blake2b(h + "|".join(name).encode(), digest_size=16).digest()
        out.append(h)
    return out


class _Sampler:
    def __init__(self, n: int, alpha: float, rng: random.Random) -> None:
        weights = [1.0 / (i + 1) ** alpha for i in range(max(1, n))]
        self.cum = list(itertools.accumulate(weights))
        self.rng = rng

    def __call__(self) -> int:
        return bisect.bisect_left(self.cum, self.rng.random() * self.cum[-1])


def generate(wl: Workload) -> Iterator[Request | Prefetch]:
    """The workload's turns and prefetch hints in time order (deterministic per seed)."""
    rng = random.Random(wl.seed)
    docs = _Sampler(wl.rag_docs, wl.zipf, rng)
    heap: list[tuple[float, int, Iterator[Request | Prefetch]]] = []
    t = 0.0
    for n in itertools.count():
        t += rng.expovariate(wl.sessions_per_second)
        if t > wl.duration:
            break
        agent = rng.random() < wl.agent_fraction
        sess = _session(wl, rng, docs, n, t, agent)
        first = next(sess, None)
        if first is not None:
            heapq.heappush(heap, (first.t, n, itertools.chain([first], sess)))
    while heap:
        _, n, it = heapq.heappop(heap)
        item = next(it)
        yield item
        following = next(it, None)
        if following is not None:
            heapq.heappush(heap, (following.t, n, itertools.chain([following], it)))


def _session(
    wl: Workload, rng: random.Random, docs: _Sampler, n: int, t: float, agent: bool
) -> Iterator[Request | Prefetch]:
    sid = f"{'agent' if agent else 'chat'}-{n}".encode()
    system = rng.randrange(max(1, wl.system_prompts))
    parts: list[tuple[str, int, int]] = [("sys", system, wl.system_tokens)]
    if agent and wl.tool_schemas:
        parts.append(("tool", rng.randrange(wl.tool_schemas), wl.tool_tokens))
    for _ in range(wl.docs_per_session if wl.rag_docs else 0):
        parts.append(("doc", docs(), wl.doc_tokens))
    mean_turns = wl.agent_turns if agent else wl.chat_turns
    turns = 1 + int(rng.expovariate(1.0 / max(1e-9, mean_turns - 1))) if mean_turns > 1 else 1
    convo = 0
    for turn in range(turns):
        convo += wl.agent_step_tokens if agent else wl.chat_user_tokens
        chain = _chain([*parts, (f"s{n}", 0, convo)], wl.chunk_tokens)
        tokens = sum(p[2] for p in parts) + convo
        yield Request(t, sid, tuple(chain), tokens)
        convo += 0 if agent else wl.chat_reply_tokens
        if turn + 1 < turns:
            gap = rng.expovariate(1.0 / (wl.agent_think if agent else wl.chat_think))
            if wl.prefetch_lead > 0 and gap > wl.prefetch_lead:
                yield Prefetch(t + gap - wl.prefetch_lead, sid)
            t += gap


class Target(Protocol):
    """What :func:`drive` needs: the simulator, or a client against a real server."""

    def match(self, ns: str, hashes: tuple[bytes, ...], tokens: int) -> int: ...
    def get(self, ns: str, h: bytes) -> object: ...
    def put(self, ns: str, h: bytes, parent: bytes, size: int, tokens: int) -> object: ...
    def session(self, ns: str, sid: bytes, tail: bytes) -> object: ...
    def prefetch_session(self, ns: str, sid: bytes, deadline_ms: int = 0) -> object: ...


def drive(target: Target, wl: Workload, item: Request | Prefetch, chunk_bytes: int) -> int:
    """Play one item the way an engine would; the chunk operations it took."""
    ns = wl.namespace
    if isinstance(item, Prefetch):
        target.prefetch_session(ns, item.session, round(wl.prefetch_deadline * 1000))
        return 1
    hashes = item.hashes
    if not hashes:
        return 0
    found = target.match(ns, hashes, item.tokens)
    for h in hashes[:found]:
        target.get(ns, h)
    for i in range(found, len(hashes)):
        parent = hashes[i - 1] if i else b""
        target.put(ns, hashes[i], parent, chunk_bytes, wl.chunk_tokens)
    target.session(ns, item.session, hashes[-1])
    return 2 * len(hashes) + 1
