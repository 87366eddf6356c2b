"""The trace format (JSON Lines) of ``kvstrata serve --trace-file PATH``: written by the server's
recorder (``kvstrata.server.trace``), read by the simulator (``kvstrata simulate --trace``).

One JSON object per line, one line per placement-changing operation, payloads never recorded::

    {"t": 0.0131, "op": "reserve", "ns": "llama", "hash": "9f…", "size": 1048576}
    {"t": 0.0132, "op": "put", "ns": "llama", "hash": "9f…", "parent": "", "size": 1048576,
     "tokens": 256}
    {"t": 0.0140, "op": "match", "ns": "llama", "hashes": ["9f…", "1c…"], "prefetch": false}
    {"t": 0.0141, "op": "get", "ns": "llama", "hash": "9f…", "tier": "dram"}
    {"t": 0.0150, "op": "lease", "ns": "llama", "hashes": ["9f…"], "to": "dram", "lease": "r7"}
    {"t": 0.0151, "op": "release", "ns": "llama", "hashes": [], "lease": "r7"}
    {"t": 0.0152, "op": "session", "ns": "llama", "session": "user-1", "hash": "1c…"}
    {"t": 30.02, "op": "prefetch", "ns": "llama", "hashes": ["9f…", "1c…"], "to": "dram"}
    {"t": 31.50, "op": "del", "ns": "llama", "hash": "1c…"}
    {"t": 31.52, "op": "demote", "ns": "", "to": "dram"}
    {"t": 31.56, "op": "demoted", "ns": "", "to": "dram"}

``t`` is seconds since the recording started; hashes and parents are hex (``""``: no parent);
session ids are text (``\\xNN``-escaped when not UTF-8). ``match`` may carry ``tokens`` (the
prompt's length) for the economics; ``put`` may carry ``ttl`` (ms) and ``prefetch`` a
``deadline`` (ms); ``lease`` a ``since`` (seconds from the lease's start to its record: its
promotions ran meanwhile, beside the other commands recorded in between). A ``prefetch``
with a ``session`` and no hashes asks the simulator to resolve the session's chain itself (the
generator writes those); the server writes the chain it resolved, and the session when it was
one (a newer prefetch of a session cancels its older one).

The server records through the store (``StoreState.trace``), from the paths every command takes
(STYLE rule 19):

- ``reserve``: a write lease's DRAM slot (KV.RESERVE, each chunk of KV.MRESERVE): it takes room
  before its chunk exists; ``abort``: the slot given back unpublished (KV.ABORT, expiry);
- ``put``: a chunk's publication (KV.PUT, KV.COMMIT of KV.RESERVE and of KV.MRESERVE: committed
  chunks only, in commit order), written when the tiers start taking it (a write-through lands
  in NVMe before the chunk is visible, and the demoter may act on it meanwhile);
- ``get``: each chunk read (KV.GET, every chunk of KV.MGET), after its lookup, with the
  ``tier`` that served it (``""``: a miss), so a replay can check itself read by read;
- ``match``: the index match (KV.MATCH, KV.MATCHTOKENS);
- ``lease``/``release``: read leases and their end (KV.RELEASE, expiry, a closed connection);
  a granted lease says which tier each chunk it leased was a read of (``found``);
- ``session``; ``prefetch``: every prefetch (KV.PREFETCH, of a session, KV.MATCH PREFETCH) with
  its chain resolved; ``fetch``: a prefetch worker starts moving one of its chunks (a replay
  moves them there, not by its own model of the workers);
- ``del``: every deletion of a live chunk (KV.DEL, DEL, expiry by TTL, FLUSHALL, a replacing
  PUT, a failed placement).

Evictions and demotions are not recorded: they are what the simulator computes. Only *when* a
round of the server's background demoter started and ended is (``demote``/``demoted``, from
``Placement.evict_to``), because under load it lags the writes (the tiers stay fuller than their
low watermark meanwhile) and its victims hold their room until their write-back is done: a
replay with such marks runs the simulated demoter's rounds at them
(:attr:`~kvstrata.sim.engine.Simulator.demoter`; the victims are still chosen by the simulator,
from its own tiers), one without runs the demoter after every command.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

OPS = (
    "put", "get", "match", "lease", "release", "session", "prefetch", "del", "demote", "demoted",
    "reserve", "abort", "fetch",
)  # fmt: skip
#: ops that name exactly one chunk (``hash``)
ONE_HASH = ("put", "get", "session", "del", "reserve", "abort", "fetch")


class TraceError(ValueError):
    """A trace line that is not a valid event (the message names the line)."""


@dataclass(frozen=True, slots=True)
class Event:
    t: float
    op: str
    ns: str
    hashes: tuple[bytes, ...] = ()  # put/get: one hash
    parent: bytes = b""
    size: int = 0
    tokens: int = 0
    session: bytes | None = None
    to: str | None = None
    prefetch: bool = False
    ttl: int = 0  # put, session: ms (0: none)
    deadline: int = 0  # prefetch: ms (0: none)
    lease: str = ""  # lease, release: the lease id ("" : no lease was granted)
    since: float = 0.0  # lease: seconds from the lease's start (its promotions) to ``t``
    tier: str | None = None  # get: the tier that served it ("": a miss; None: not recorded)
    found: tuple[str, ...] = ()  # lease: the tier each leased chunk was a read of


def _hex(value: Any, what: str) -> bytes:
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a hex string")
    return bytes.fromhex(value)


def parse_event(obj: Any) -> Event:
    """An :class:`Event` from one decoded JSON object; ValueError when malformed."""
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    op = obj.get("op")
    if op not in OPS:
        raise ValueError(f"unknown op {op!r} (ops: {', '.join(OPS)})")
    ns = obj.get("ns")
    if not isinstance(ns, str):
        raise ValueError("ns must be a string")
    t = float(obj.get("t", 0.0))
    if "hashes" in obj:
        raw = obj["hashes"]
        if not isinstance(raw, list):
            raise ValueError("hashes must be a list")
        hashes = tuple(_hex(h, "hash") for h in raw)
    elif "hash" in obj:
        hashes = (_hex(obj["hash"], "hash"),)
    else:
        hashes = ()
    if op in ONE_HASH and len(hashes) != 1:
        raise ValueError(f"{op} needs one hash")
    sid = obj.get("session")
    size = int(obj.get("size", 0))
    if op in ("put", "reserve") and size <= 0:
        raise ValueError(f"{op} needs a positive size")
    return Event(
        t=t,
        op=op,
        ns=ns,
        hashes=hashes,
        parent=_hex(obj.get("parent", ""), "parent"),
        size=size,
        tokens=int(obj.get("tokens", 0)),
        session=None if sid is None else str(sid).encode("utf-8", "surrogateescape"),
        to=obj.get("to"),
        prefetch=bool(obj.get("prefetch", False)),
        ttl=int(obj.get("ttl", 0)),
        deadline=int(obj.get("deadline", 0)),
        lease=str(obj.get("lease", "")),
        since=max(0.0, float(obj.get("since", 0.0))),
        tier=None if obj.get("tier") is None else str(obj["tier"]),
        found=tuple(str(t) for t in obj.get("found") or ()),
    )


def read_trace(path: str | Path) -> Iterator[Event]:
    """The events of a trace file, in order; TraceError names a bad line."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield parse_event(json.loads(line))
            except (ValueError, TypeError) as exc:
                raise TraceError(f"{path}:{n}: {exc}") from None


def event_dict(ev: Event) -> dict[str, Any]:
    out: dict[str, Any] = {"t": round(ev.t, 6), "op": ev.op, "ns": ev.ns}
    if ev.op in ONE_HASH:
        out["hash"] = ev.hashes[0].hex()
    elif ev.hashes or ev.op not in ("prefetch", "demote", "demoted", "release"):
        out["hashes"] = [h.hex() for h in ev.hashes]
    if ev.op == "put":
        out.update(parent=ev.parent.hex(), size=ev.size, tokens=ev.tokens)
    elif ev.op == "reserve":
        out["size"] = ev.size
    if ev.session is not None:
        out["session"] = ev.session.decode("utf-8", "backslashreplace")
    if ev.op in ("lease", "prefetch", "demote", "demoted", "fetch"):
        out["to"] = ev.to
    if ev.op == "match":
        out["prefetch"] = ev.prefetch
        if ev.tokens:
            out["tokens"] = ev.tokens
    if ev.ttl:
        out["ttl"] = ev.ttl
    if ev.deadline:
        out["deadline"] = ev.deadline
    if ev.lease:
        out["lease"] = ev.lease
    if ev.since:
        out["since"] = round(ev.since, 6)
    if ev.tier is not None:
        out["tier"] = ev.tier
    if ev.found:
        out["found"] = list(ev.found)
    return out


def write_trace(events: Iterable[Event], f: IO[str]) -> int:
    n = 0
    for ev in events:
        f.write(json.dumps(event_dict(ev), separators=(",", ":")) + "\n")
        n += 1
    return n
