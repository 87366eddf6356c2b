"""Replies that wait before they are handed to the transport, so that a client that does not
read cannot pin DRAM beyond a bound.

A zero-copy reply (a ``BulkView`` of an arena slot) pins its chunk until the transport has
written it, and a transport keeps what it was handed for as long as the client does not read:
once handed, the arena bytes cannot be taken back. So a connection hands the transport at most
a window of reply bytes (half of ``reply-pin-max``) at a time; what does not fit waits here,
in order, and is handed on as the transport drains (``resume_writing``). A reply that fits the
window on an idle transport (the common case, a KV.GET of up to 16 MiB by default) never
comes here.

When a connection's replies have pinned more than ``reply-pin-max`` bytes for longer than
``reply-pin-timeout`` (see ``writeside``), :meth:`ReplyBacklog.copy_out` copies the waiting
arena views into private memory and releases their pins: a slow reader still gets every byte
(chunks are immutable once published, so the copy is the chunk), and DRAM may evict those
chunks. The private copies count towards ``client-output-buffer-limit`` like any unsent
output.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

Release = Callable[[], None]
#: a pinned view collected from a reply, with the callback that unpins its chunk
Pinned = tuple[memoryview, Release]


class ReplyBacklog:
    def __init__(self) -> None:
        # [part, release or None, bytes it pins]; a pinned part is the whole view of a chunk,
        # or the rest of one whose head was handed already (``_head_started``)
        self._parts: deque[list[Any]] = deque()
        self._head_started = False
        self.nbytes = 0  # bytes waiting
        self.pinned = 0  # bytes of the chunks that waiting parts pin
        self.copied = 0  # bytes copied out of the arena, ever (INFO)

    def __bool__(self) -> bool:
        return bool(self._parts)

    def add(self, out: list[Any], pins: list[Pinned]) -> list[tuple[Release, int]]:
        """Queue the reply buffers ``out``, matching the pinned views in them (in order);
        returns the pins whose view is not among them (copied while encoding: release once
        what was handed before is written)."""
        k, n = 0, len(pins)
        parts = self._parts
        for part in out:
            if k < n and part is pins[k][0]:
                size = part.nbytes
                parts.append([part, pins[k][1], size])
                self.pinned += size
                k += 1
            else:
                parts.append([part, None, 0])
            self.nbytes += len(part)
        return [(release, view.nbytes) for view, release in pins[k:]]

    def take(self, budget: int) -> tuple[list[Any], list[tuple[Release, int]]]:
        """Up to ``budget`` bytes from the head (a view split where the budget ends), and the
        pins of the views now handed whole (release them once the transport wrote them)."""
        parts = self._parts
        taken: list[Any] = []
        done: list[tuple[Release, int]] = []
        while parts and budget > 0:
            head = parts[0]
            part = head[0]
            size = len(part)
            if size > budget:
                view = memoryview(part)
                taken.append(view[:budget])
                head[0] = view[budget:]
                self._head_started = True
                self.nbytes -= budget
                break
            parts.popleft()
            taken.append(part)
            budget -= size
            self.nbytes -= size
            self._head_started = False
            if head[1] is not None:
                done.append((head[1], head[2]))
                self.pinned -= head[2]
        return taken, done

    def copy_out(self) -> tuple[list[Release], list[tuple[Release, int]]]:
        """Copy every waiting pinned view into private memory; returns the pins to release
        now and the one whose head the transport still holds (release once it is written)."""
        now: list[Release] = []
        later: list[tuple[Release, int]] = []
        for i, entry in enumerate(self._parts):
            release = entry[1]
            if release is None:
                continue
            entry[0] = bytes(entry[0])
            self.copied += len(entry[0])
            if i == 0 and self._head_started:
                later.append((release, entry[2]))
            else:
                now.append(release)
            entry[1], entry[2] = None, 0
        self.pinned = 0
        return now, later

    def release_all(self) -> list[Release]:
        """Forget everything (the connection is gone); the pins to release."""
        releases = [entry[1] for entry in self._parts if entry[1] is not None]
        self._parts.clear()
        self.nbytes = self.pinned = 0
        self._head_started = False
        return releases
