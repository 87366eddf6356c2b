"""``trace-file``: the server's recorder of placement-changing operations, in the JSON Lines
format of :mod:`kvstrata.tracefile` (which the simulator reads); the store reports to it
(``StoreState.trace``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstrata.tracefile import Event, write_trace


class TraceRecorder:
    """Appends the store's placement-changing operations to a trace file (line buffered, so a
    crash loses at most the line being written); the store calls :meth:`record` (it is the
    store's ``Tracer``). Sizes and hashes only."""

    def __init__(self, path: str | Path) -> None:
        self._f = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 (kept open)
        self._t0 = time.monotonic()

    def record(self, op: str, ns: str, hashes: Sequence[bytes], **kw: Any) -> None:
        """One event; ``kw``: the :class:`Event` fields after ``hashes`` (parent, size, …)."""
        t = time.monotonic() - self._t0
        write_trace([Event(t, op, ns, tuple(hashes), **kw)], self._f)

    def close(self) -> None:
        self._f.close()
