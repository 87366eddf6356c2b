"""The connection's side of the compiled small-command path (``kvstrata.server.fastpath``).

``Connection.buffer_updated`` hands a read to :meth:`FastRead._run_lean` when the connection is
idle (nothing queued, paused, pending or half-received) and the compiled path is usable: one C
run, the counters ``_process`` would update, one ``transport.write``. ``_process`` calls
:meth:`FastRead._run_fast` for the leading commands of a batch, and again after each command
the Python path ran (which may have changed what the compiled path depends on).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from kvstrata.server.context import ClientState
from kvstrata.server.fastpath import MAX_OUT, NAMES, _ext
from kvstrata.server.intake import Intake

if TYPE_CHECKING:
    from kvstrata.server.app import Server

FLUSH_PARTS = 48  # reply buffers gathered before they are handed to the transport
if _ext is not None:  # ConnBase's lean read, the C twin of _run_lean, uses the same bounds
    _ext.set_conn_limits(FLUSH_PARTS, MAX_OUT)


class FastRead:
    """Mixin of ``Connection``: the compiled path's runs and the per-read lean path."""

    # state owned by Connection
    server: Server
    client: ClientState
    transport: asyncio.Transport | None
    _in: Intake
    _out: list[Any]
    _busy: bool
    _write_paused: bool
    _unsent: bool
    _resp3: bool
    _slow: float
    _slow_micros: int | None

    if TYPE_CHECKING:  # Connection's and WriteSide's (a stub here would shadow WriteSide's)

        def _process(self, declined: int = -1) -> None: ...
        def _flush(self) -> None: ...
        def _after_write(self) -> None: ...

    def _run_lean(self, fast: Any, values: dict[str, Any]) -> None:
        """The lean path: a read of small commands on an idle connection (see buffer_updated)
        runs on the compiled path and is answered with one write, doing what _process and
        _flush would do for it without their general checks. Anything else, and whatever the
        run leaves in the buffer, goes the general way."""
        intake = self._in
        out = self._out
        if values["slowlog-log-slower-than"] != self._slow_micros:
            self._slow_threshold(values)
        pos, ran, last, slow = fast.run(
            intake.buf, intake.start, intake.end, out, self._resp3, values["proto-max-bulk-len"],
            values["max-multibulk-len"], self._slow, MAX_OUT,
        )  # fmt: skip
        if not ran:
            self._process(declined=intake.start)
            return
        server, client = self.server, self.client
        stats = server.stats
        stats.total_commands_processed += ran
        client.commands += ran
        client.last_command = NAMES[last]
        if slow is not None:
            server.slowlog_record(slow[0], slow[1], client)
        if pos != intake.end or len(out) != 1:  # a command for the Python path follows
            intake.start = pos
            if len(out) >= FLUSH_PARTS or len(out[-1]) >= MAX_OUT:
                self._flush()  # lets the transport push back (pause_writing)
            self._process()
            return
        intake.start = intake.end = 0
        data = out.pop()
        stats.total_net_output_bytes += len(data)
        self.transport.write(data)  # type: ignore[union-attr]
        if self._unsent:  # else no pins are pending (out was empty) and nothing is queued
            self._after_write()

    def _slow_threshold(self, values: dict[str, Any]) -> float:
        """The slow-log threshold in seconds (``self._slow``), recomputed when its setting
        changed (the slow log itself exists or not for the server's life)."""
        micros = values["slowlog-log-slower-than"]
        if micros != self._slow_micros:
            self._slow_micros = micros
            self._slow = self.server.slowlog_threshold
        return self._slow

    def _run_fast(self, fast: Any, limits: tuple[int, int]) -> int:
        """Run the leading buffered commands on the compiled path (kvstrata.server.fastpath);
        how many it ran (0: the Python path decodes what follows)."""
        intake = self._in
        if self._busy or self._write_paused or intake.partial is not None:
            return 0
        if intake.start == intake.end or intake.receiving_payload:
            return 0
        out = self._out
        pos, ran, last, slow = fast.run(
            intake.buf, intake.start, intake.end, out, self._resp3, limits[0], limits[1],
            self._slow, MAX_OUT,
        )  # fmt: skip
        if not ran:
            return 0
        intake.start = pos
        self.client.last_command = NAMES[last]
        if slow is not None:
            self.server.slowlog_record(slow[0], slow[1], self.client)
        if pos != intake.end and (len(out) >= FLUSH_PARTS or len(out[-1]) >= MAX_OUT):
            self._flush()  # lets the transport push back (pause_writing)
        return ran
