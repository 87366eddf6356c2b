"""The receive side of a connection: its buffer, request decoding and in-place large payloads.

:class:`Intake` owns the bytes a client sent and turns them into commands; it does no I/O and
runs nothing. The connection hands ``get_buffer``/``received`` the transport's callbacks and
takes decoded commands from the queue it passes to :meth:`Intake.decode`.

A bulk argument of :data:`BIG` bytes or more is received in place: ``sink_for(args, nbytes)``
(the command's payload sink, e.g. an arena slot for ``KV.PUT``) gives its destination, the bytes
already buffered are copied there once, and ``get_buffer`` then returns the rest of the
destination so the kernel writes the payload where it will live; a sink with a ``received(filled)``
method is told after every read how much of it is filled (``StoreSink`` checksums the bytes
while they are still in the CPU cache). A bulk without a sink lands in
a :class:`PagedBulk` (or, where the system refuses the mapping, a :class:`GrowingBulk`): as in
Redis, memory grows with the bytes that arrive, never with the length a client declares
(``$1073741824`` followed by nothing costs a few pages).
"""

from __future__ import annotations

import mmap
import sys
from collections.abc import Callable
from typing import Any

from kvstrata.protocol import decoder
from kvstrata.protocol.errors import ProtocolError

BIG = 64 * 1024  # bulk arguments at least this large are received in place
#: an incomplete command holding this many bytes is parsed incrementally from then on (the
#: scanner would otherwise rescan it from its start each time bytes arrive: quadratic work for
#: a client that trickles a command of a million small arguments)
INCREMENTAL = 1024 * 1024
SLICE_ARGS = 65536  # arguments parsed incrementally per call before the loop gets a turn
INITIAL_BUFFER = 64 * 1024


FIRST_GROWTH = 1024 * 1024  # a growing bulk's first buffer (or its length when smaller)
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)


class PagedBulk:
    """Default destination of a large bulk: an anonymous private mapping of its declared length.
    The kernel provides its pages as the payload lands in them, so memory grows with the bytes
    received (a declared length costs address space only), nothing is copied, and the memory
    goes back to the system when the argument is dropped."""

    __slots__ = ("view",)

    def __init__(self, length: int) -> None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE
        self.view = memoryview(mmap.mmap(-1, length, flags=flags))


class GrowingBulk:
    """Default destination of a large bulk: a bytearray that doubles as bytes arrive (so a
    declared length costs nothing until it is sent) and becomes the argument when complete."""

    __slots__ = ("data", "filled", "length")

    def __init__(self, length: int, first: bytes | memoryview) -> None:
        self.length = length
        self.filled = len(first)
        self.data = bytearray(min(length, max(FIRST_GROWTH, self.filled)))
        self.data[: self.filled] = first

    def room(self) -> memoryview:
        """Where the next bytes go (grown first when the buffer is full)."""
        if self.filled == len(self.data):
            bigger = bytearray(min(self.length, 2 * len(self.data)))
            bigger[: self.filled] = self.data
            self.data = bigger
        return memoryview(self.data)[self.filled :]


class WithSinks:
    """A decoded command whose large arguments landed in sinks (by argument index)."""

    __slots__ = ("args", "nbytes", "need_crlf", "remaining", "sinks")

    def __init__(self, args: list[Any], remaining: int, sinks: dict[int, Any]) -> None:
        self.args = args
        self.remaining = remaining
        self.sinks = sinks
        self.need_crlf = True
        self.nbytes = 0  # bytes of its large bulks (counted in Intake.queued_payload)


def abort_sinks(sinks: dict[int, Any], on_error: Callable[[BaseException], None]) -> None:
    for sink in sinks.values():
        try:
            sink.abort()
        except Exception as exc:
            on_error(exc)


class Intake:
    """Receive buffer + decoder state of one connection (slots: the compiled read callbacks,
    ``_fastpath.ConnBase``, read them by offset)."""

    __slots__ = (
        "_direct", "_filled", "_grow", "_mv", "_progress", "_sink_for", "buf", "end", "overflow",
        "partial", "partial_bytes", "queued_payload", "start", "yielded",
    )  # fmt: skip

    def __init__(self, sink_for: Callable[[list[Any], int], Any]) -> None:
        self._sink_for = sink_for
        self.buf = bytearray(INITIAL_BUFFER)
        self._mv = memoryview(self.buf)
        self.start = 0
        self.end = 0
        self.partial: WithSinks | None = None
        self._direct: memoryview | None = None
        self._progress: Callable[[int], None] | None = None  # the direct sink's ``received``
        self._grow: GrowingBulk | None = None
        self._filled = 0
        #: set when the buffer would grow past the query buffer limit
        self.overflow = False
        #: bytes of small arguments already parsed into ``partial`` (they count against the
        #: query buffer limit like the bytes still buffered)
        self.partial_bytes = 0
        #: the last decode stopped after SLICE_ARGS arguments with more bytes to parse: the
        #: connection calls again on a later turn of the event loop
        self.yielded = False
        #: bytes of large bulks decoded (or arriving) and not run yet; the connection
        #: subtracts a command's ``nbytes`` when it runs it
        self.queued_payload = 0

    @property
    def backlog(self) -> int:
        """Bytes received and not decoded yet."""
        return self.end - self.start

    @property
    def receiving_payload(self) -> bool:
        """A large bulk is being received in place."""
        return self._direct is not None or self._grow is not None

    # -- transport side -------------------------------------------------------------------
    def get_buffer(self, limit: int) -> memoryview:
        if self._direct is not None:
            return self._direct[self._filled :]
        if self._grow is not None:
            return self._grow.room()
        if self.partial is not None and self.partial_bytes + self.end - self.start > limit:
            self.start = self.end = 0  # the connection reports it and closes
            self.overflow = True
        if not self.end:
            return self._mv  # the whole buffer (no slice to allocate: the common case)
        if self.end == len(self.buf):
            self._make_room(limit)
        return self._mv[self.end :]

    def received(self, nbytes: int) -> bool:
        """Account for ``nbytes`` written by the kernel; False while a payload is incomplete."""
        if self._direct is not None:
            self._filled += nbytes
            if self._progress is not None:
                self._progress(self._filled)
            if self._filled < self._direct.nbytes:
                return False
            self._direct = self._progress = None
            return True
        grow = self._grow
        if grow is not None:
            grow.filled += nbytes
            if grow.filled < grow.length:
                return False
            assert self.partial is not None
            self.partial.args[-1] = grow.data  # the argument is the complete buffer
            self._grow = None
            return True
        self.end += nbytes
        return True

    def _make_room(self, limit: int) -> None:
        """The buffer is full: move the pending bytes to its front when that frees at least
        half of it, else double it (moving megabytes to free a few would be quadratic)."""
        pending = self.end - self.start
        if self.start > 0 and (self.start >= len(self.buf) // 2 or len(self.buf) >= limit):
            data = bytes(self._mv[self.start : self.end])
            self.buf[:pending] = data
            self.start, self.end = 0, pending
            return
        if len(self.buf) >= limit:
            # Drop what is buffered (the client is being closed); the connection reports it.
            self.start = self.end = 0
            self.overflow = True
            return
        bigger = bytearray(len(self.buf) * 2)
        bigger[:pending] = self._mv[self.start : self.end]
        self._mv.release()
        self.buf = bigger
        self._mv = memoryview(bigger)
        self.start, self.end = 0, pending

    # -- decoding -------------------------------------------------------------------------
    def decode(self, queue: Any, max_bulk: int, max_args: int) -> bool:
        """Decode buffered commands into ``queue``; False when nothing more can be decoded.

        Commands with sinks are queued as :class:`WithSinks`, others as plain lists."""
        self.yielded = False
        if self.partial is not None:
            return self._continue(queue, max_bulk)
        if self.start == self.end or self.receiving_payload:
            return False
        cmds, pos, state = decoder.parse_requests(
            self.buf, self.start, self.end, BIG, max_bulk, max_args
        )
        self.start = pos
        queue.extend(cmds)
        if state is None:
            if not cmds and self.end - self.start >= INCREMENTAL:
                return self._begin_incremental(queue, max_bulk)
            return bool(cmds)
        if state == decoder.INLINE:
            if cmds:  # run them first: a malformed quoted line errors after their replies
                return True
            inline, pos = decoder.parse_inlines(self.buf, self.start, self.end)
            moved = pos != self.start
            self.start = pos
            queue.extend(inline)
            return bool(cmds) or moved
        self._begin_big(state, {})
        return True

    def _begin_big(self, state: tuple[Any, ...], sinks: dict[int, Any], nbytes: int = 0) -> None:
        args, remaining, length, data_pos = state  # a BigBulk, or the C scanner's tuple
        self.partial = WithSinks(args, remaining - 1, sinks)
        self.partial.nbytes = nbytes + length
        self.queued_payload += length
        have = max(0, min(self.end - data_pos, length))
        sink = self._sink_for(args, length)
        if sink is None:
            try:
                sink = PagedBulk(length)
            except OSError:  # strict overcommit refused the mapping: grow a buffer instead
                grow = GrowingBulk(length, self._mv[data_pos : data_pos + have])
                args.append(grow.data)
                self._grow = grow if have < length else None
        if type(sink) is PagedBulk:
            args.append(sink.view)
            sink.view[:have] = self._mv[data_pos : data_pos + have]
            if have < length:
                self._direct, self._filled = sink.view, have
        elif sink is not None:
            sinks[len(args)] = sink
            args.append(sink.view)
            if have > 0:
                sink.view[:have] = self._mv[data_pos : data_pos + have]
            progress = getattr(sink, "received", None)
            if progress is not None:
                progress(have)
            if have < length:
                self._direct = sink.view.cast("B") if sink.view.format != "B" else sink.view
                self._filled, self._progress = have, progress
        if have < length:
            self.start = self.end = 0
        else:
            self.start = data_pos + length

    def _begin_incremental(self, queue: Any, max_bulk: int) -> bool:
        """Go on with the incomplete multibulk at ``start`` argument by argument (its header
        was checked by the scanner, which stopped at the command's end)."""
        nl = self.buf.find(b"\r\n", self.start, self.end)
        count = int(self._mv[self.start + 1 : nl])
        self.partial = WithSinks([], count, {})
        self.partial.need_crlf = False
        self.start = nl + 2
        return self._continue(queue, max_bulk)

    def _continue(self, queue: Any, max_bulk: int) -> bool:
        """Finish the command of a large bulk; False when more bytes are needed."""
        part = self.partial
        assert part is not None
        if self.receiving_payload:
            return False
        if part.need_crlf:
            if self.end - self.start < 2:
                return False
            if self.buf[self.start : self.start + 2] != b"\r\n":
                raise ProtocolError("expected CRLF after bulk data")
            self.start += 2
            part.need_crlf = False
        if part.remaining:
            before, total = len(part.args), part.remaining
            n = min(total, SLICE_ARGS)
            pos, state = decoder.parse_args(
                self.buf, self.start, self.end, n, BIG, max_bulk, part.args
            )
            part.remaining -= len(part.args) - before
            self.partial_bytes += pos - self.start
            self.start = pos
            if state is None:
                return False
            if state is not True:  # another large bulk (its args are part.args)
                args, left, length, data_pos = state  # ``left`` counts within the slice
                self.partial = None
                self._begin_big((args, left + total - n, length, data_pos), part.sinks, part.nbytes)
                return not self.receiving_payload
            if part.remaining:  # a slice of a long command: let the loop run in between
                self.yielded = self.start < self.end
                return False
        self.partial = None
        self.partial_bytes = 0
        queue.append(part)
        return True

    def drop(self) -> dict[int, Any]:
        """Forget a half-received command; its sinks are returned for aborting."""
        part, self.partial, self._direct, self._grow = self.partial, None, None, None
        self._progress = None
        self.partial_bytes = 0
        if part is None:
            return {}
        self.queued_payload -= part.nbytes
        return part.sinks

    def compact(self) -> None:
        if self.start == self.end and not self.receiving_payload:
            self.start = self.end = 0
