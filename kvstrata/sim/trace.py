"""The trace format (JSON Lines) and its recorder (``kvstrata serve --trace-file PATH``).

One JSON object per line, one line per KV command, payloads never recorded::

    {"t": 0.0132, "op": "put", "ns": "llama", "hash": "9f…", "parent": "", "size": 1048576,
     "tokens": 256}
    {"t": 0.0140, "op": "match", "ns": "llama", "hashes": ["9f…", "1c…"], "prefetch": false}
    {"t": 0.0141, "op": "get", "ns": "llama", "hash": "9f…"}
    {"t": 0.0150, "op": "lease", "ns": "llama", "hashes": ["9f…"], "to": null}
    {"t": 0.0152, "op": "session", "ns": "llama", "session": "user-1", "hash": "1c…"}
    {"t": 30.02, "op": "prefetch", "ns": "llama", "session": "user-1", "to": null}
    {"t": 30.03, "op": "prefetch", "ns": "llama", "hashes": ["9f…"], "to": "dram"}

``t`` is seconds since the recording started; hashes and parents are hex (``""``: no parent);
session ids are text (``\\xNN``-escaped when not UTF-8). ``match`` may carry ``tokens`` (the
prompt's length) for the economics. ``mget`` is written as one ``get`` per hash.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

OPS = ("put", "get", "match", "lease", "session", "prefetch")


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
    if op in ("put", "get", "session") and len(hashes) != 1:
        raise ValueError(f"{op} needs one hash")
    sid = obj.get("session")
    size = int(obj.get("size", 0))
    if op == "put" and size <= 0:
        raise ValueError("put needs a positive size")
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
    if ev.op in ("put", "get", "session"):
        out["hash"] = ev.hashes[0].hex()
    elif ev.hashes or ev.op != "prefetch":
        out["hashes"] = [h.hex() for h in ev.hashes]
    if ev.op == "put":
        out.update(parent=ev.parent.hex(), size=ev.size, tokens=ev.tokens)
    if ev.session is not None:
        out["session"] = ev.session.decode("utf-8", "backslashreplace")
    if ev.op in ("lease", "prefetch"):
        out["to"] = ev.to
    if ev.op == "match":
        out["prefetch"] = ev.prefetch
        if ev.tokens:
            out["tokens"] = ev.tokens
    return out


def write_trace(events: Iterable[Event], f: IO[str]) -> int:
    n = 0
    for ev in events:
        f.write(json.dumps(event_dict(ev), separators=(",", ":")) + "\n")
        n += 1
    return n


class TraceRecorder:
    """Appends the server's KV commands to a trace file (line buffered, so a crash loses at
    most the line being written). One call per command; sizes and hashes only."""

    def __init__(self, path: str | Path) -> None:
        self._f = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 (kept open)
        self._t0 = time.monotonic()

    def record(
        self,
        op: str,
        ns: str,
        hashes: Sequence[bytes],
        *,
        parent: bytes = b"",
        size: int = 0,
        tokens: int = 0,
        session: bytes | None = None,
        to: str | None = None,
        prefetch: bool = False,
    ) -> None:
        t = time.monotonic() - self._t0
        ev = Event(t, op, ns, tuple(hashes), parent, size, tokens, session, to, prefetch)
        if op == "get" and len(hashes) != 1:  # KV.MGET
            for h in hashes:
                write_trace([Event(t, "get", ns, (h,))], self._f)
            return
        write_trace([ev], self._f)

    def close(self) -> None:
        self._f.close()
