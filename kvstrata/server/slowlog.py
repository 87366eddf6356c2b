"""The slow log: commands that ran longer than ``slowlog-log-slower-than`` microseconds.

The connection calls :meth:`SlowLog.record` after every command, so the fast path is one
comparison. Both settings are read from the live config at record time, so ``CONFIG SET``
applies at once. Entries keep what Redis keeps: at most 32 arguments (the last one says how
many more there were), each cut to 128 bytes (with a note of how many bytes were cut).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from kvstrata.config import Config
from kvstrata.server.context import ClientState

MAX_ARGS = 32
MAX_ARG_BYTES = 128


@dataclass(frozen=True, slots=True)
class SlowLogEntry:
    id: int
    timestamp: int  # unix seconds
    duration_us: int
    argv: tuple[bytes, ...]
    client_addr: str
    client_name: bytes

    def reply(self) -> list[Any]:
        """The SLOWLOG GET entry (Redis shape)."""
        return [
            self.id,
            self.timestamp,
            self.duration_us,
            list(self.argv),
            self.client_addr,
            self.client_name,
        ]


def _trim_arg(arg: Any) -> bytes:
    if isinstance(arg, str):
        arg = arg.encode()
    size = len(arg) if not isinstance(arg, memoryview) else arg.nbytes
    if size <= MAX_ARG_BYTES:
        return bytes(arg)
    head = bytes(memoryview(arg).cast("B")[:MAX_ARG_BYTES])
    return head + f"... ({size - MAX_ARG_BYTES} more bytes)".encode()


def trim_argv(argv: list[Any]) -> tuple[bytes, ...]:
    """Copy an argument vector the way Redis stores it in the slow log.

    Large payloads (memoryviews over arena slots) are never copied whole.
    """
    if len(argv) > MAX_ARGS:
        kept = [_trim_arg(a) for a in argv[: MAX_ARGS - 1]]
        kept.append(f"... ({len(argv) - MAX_ARGS + 1} more arguments)".encode())
        return tuple(kept)
    return tuple(_trim_arg(a) for a in argv)


class SlowLog:
    """Newest entries first, bounded by ``slowlog-max-len``."""

    def __init__(self, config: Config) -> None:
        self._config = config
        self._entries: deque[SlowLogEntry] = deque()
        self._next_id = 0

    def record(self, duration_us: int, argv: list[Any], client: ClientState) -> None:
        """Log the command if it was slow (cheap when it was not)."""
        if duration_us < self._config.values["slowlog-log-slower-than"]:
            return
        self._add(duration_us, argv, client)

    def _add(self, duration_us: int, argv: list[Any], client: ClientState) -> None:
        threshold = self._config.values["slowlog-log-slower-than"]
        max_len = self._config.values["slowlog-max-len"]
        if threshold < 0 or max_len <= 0:
            return
        entry = SlowLogEntry(
            id=self._next_id,
            timestamp=int(time.time()),
            duration_us=duration_us,
            argv=trim_argv(argv),
            client_addr=client.addr,
            client_name=client.name,
        )
        self._next_id += 1
        self._entries.appendleft(entry)
        while len(self._entries) > max_len:
            self._entries.pop()

    def get(self, count: int = 10) -> list[SlowLogEntry]:
        """The newest ``count`` entries (all of them when ``count`` is -1)."""
        if count < 0:
            return list(self._entries)
        return [e for _, e in zip(range(count), self._entries, strict=False)]

    def reset(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
