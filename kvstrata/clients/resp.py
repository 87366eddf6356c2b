"""Client-side RESP2/RESP3 reply parsing with receive-in-place for large bulks. No I/O.

:class:`ReplyReader` is a sans-I/O, resumable parser shared by the blocking and the asyncio
connections. The connection asks it where to receive (:meth:`ReplyReader.get_buffer`), tells it
how many bytes arrived (:meth:`ReplyReader.buffer_updated`) and gets each complete reply through
a callback, in order. Partial input is an expected state: aggregates in progress live on an
explicit stack, so a reply split at any offset is never re-parsed from the start.

Large bulks are not accumulated in the read buffer. When a top-level bulk reply has a caller
buffer (``out``: a bytearray, memoryview, numpy array or CPU torch tensor) the reader copies what
is already buffered into it and then hands out the rest of ``out`` itself as the receive buffer,
so the kernel writes the payload straight into its final place (``recv_into``). While a reply
with an ``out`` is expected, reads into the reader's own buffer are capped at
:data:`HEADER_READ` bytes, so at most that much of a payload is copied from the read buffer
into ``out`` (an uncapped read would take up to :data:`READ_BUFFER` bytes of it). Without a
caller buffer, a bulk of at least ``big`` bytes is received into one preallocated ``bytearray``.
An ``out`` may also be a list of buffers, one per element of a top-level array (``KV.MGET``).

A reply that lies whole in the read buffer and holds only arrays, bulks shorter than ``big``,
integers, simple strings and nulls (``KV.MRESERVE``'s and ``KV.LEASE``'s handles, ``OK``, most
replies) is parsed in one call by the compiled ``_cresp.parse_reply`` when it was built; the
rest, and every reply without it, by the resumable Python parser, which gives the same values.

Value mapping: bulk → ``bytes`` (``bytearray`` when received in place, ``memoryview`` of the
filled part of ``out``), simple → :class:`~kvstrata.protocol.frames.Simple`, integer/big number
→ ``int``, double → ``float``, boolean → ``bool``, null → ``None``, array/set → ``list``, map →
``dict``, verbatim → ``bytes`` (without the ``txt:`` prefix), push →
:class:`~kvstrata.protocol.frames.Push`, error → a
:class:`~kvstrata.protocol.errors.RespError` instance (returned, not raised: inside a pipeline one
error does not hide the other replies). Attributes (``|``) are skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstrata.protocol.encoder import LARGE as LARGE_ARG
from kvstrata.protocol.encoder import encode_command, join_small
from kvstrata.protocol.errors import CommandError, ProtocolError, error_from_reply
from kvstrata.protocol.frames import Push, Simple

try:  # the compiled parser of whole, plain replies (kvstrata/protocol/_cresp.c)
    from kvstrata.protocol._cresp import parse_reply as _c_parse_reply
except ImportError:  # no compiler at install: the Python parser alone
    _c_parse_reply = None

__all__ = [
    "BIG_BULK",
    "BufferTooSmall",
    "OutSpec",
    "ReplyReader",
    "as_bytes_view",
    "as_writable_view",
    "command_buffers",
]

BIG_BULK = 64 * 1024  # bulks at least this long are received in place
READ_BUFFER = 256 * 1024
HEADER_READ = 4096  # read size while the next bulk may go to a caller's buffer
MAX_LINE = 64 * 1024
#: Where the payload of one reply lands: one buffer, one per array element, or nothing.
OutSpec = Any


class BufferTooSmall(CommandError):
    """The caller's buffer cannot hold the bulk reply (the bytes were read and dropped)."""


def as_writable_view(obj: Any) -> memoryview:
    """A flat, writable byte view of a bytearray, memoryview, numpy array or CPU torch tensor."""
    if type(obj).__module__.startswith("torch"):
        if obj.device.type != "cpu" or not obj.is_contiguous():
            raise ValueError("a torch tensor used as a buffer must be contiguous and on the CPU")
        obj = obj.reshape(-1).view(dtype=_torch_uint8()).numpy()
    view = memoryview(obj)
    if view.readonly:
        raise ValueError("the buffer is read-only")
    if not view.c_contiguous:
        raise ValueError("the buffer must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def as_bytes_view(obj: Any) -> bytes | memoryview:
    """A flat byte view of any payload (bytes-like, numpy array, CPU torch tensor), no copy."""
    if isinstance(obj, bytes):
        return obj
    if type(obj).__module__.startswith("torch"):
        if obj.device.type != "cpu":
            raise ValueError("send a CPU tensor (or use a lease/reserve for device memory)")
        obj = obj.contiguous().reshape(-1).view(dtype=_torch_uint8()).numpy()
    view = memoryview(obj)
    if not view.c_contiguous:
        raise ValueError("a payload must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _torch_uint8() -> Any:
    import torch

    return torch.uint8


def _wire_arg(arg: Any) -> Any:
    if isinstance(arg, str | bytes | int | float):
        return arg
    return as_bytes_view(arg)


#: commands with more arguments than this are tried as a chain (:func:`_chain_wire`)
CHAIN_ARGS = 8
#: trailing option words a chain command may end with (``WITHTIERS``, ``PREFETCH``, ``TIER x``)
_CHAIN_TAIL = 4


def command_buffers(args: Sequence[Any]) -> list[Any]:
    """One command as a list of buffers: small parts joined, large arguments kept separate."""
    if len(args) > CHAIN_ARGS:
        wire = _chain_wire(args)
        if wire is not None:
            return [wire]
    parts: list[Any] = []
    encode_command([_wire_arg(a) for a in args], parts)
    return join_small(parts)


def _chain_wire(args: Sequence[Any]) -> bytes | None:
    """The wire form of a command carrying a chain of hashes (``KV.MATCH ns h… [PREFETCH]``),
    or None when ``args`` is not one: from the third argument on, a run of ``bytes`` of one
    length (below ``LARGE``), then at most :data:`_CHAIN_TAIL` arguments of any kind. The run is
    encoded by one ``join`` (the hashes are never formatted one by one in Python): the same
    bytes :func:`encode_command` writes, about 20× faster for 500 hashes."""
    end = len(args)
    while end > 3 and end > len(args) - _CHAIN_TAIL and type(args[end - 1]) is not bytes:
        end -= 1
    run = args[2:end]
    if len(run) < CHAIN_ARGS or set(map(type, run)) != {bytes}:
        return None
    size = len(run[0])
    if size >= LARGE_ARG or len(set(map(len, run))) != 1:
        return None
    head: list[Any] = []
    encode_command([_wire_arg(a) for a in args[:2]], head)
    tail: list[Any] = []
    encode_command([_wire_arg(a) for a in args[end:]], tail)
    if any(type(p) is not bytes for p in tail):  # a large trailing payload: the general way
        return None
    sep = b"\r\n$%d\r\n" % size
    return b"".join((b"*%d\r\n" % len(args), *head[1:], sep[2:], sep.join(run), b"\r\n", *tail[1:]))


@dataclass(slots=True)
class _Frame:
    kind: int  # the type byte of the aggregate
    need: int  # items still to come (2 per entry for maps and attributes)
    items: list[Any]


@dataclass(slots=True)
class _Target:
    """A bulk being received in place."""

    view: memoryview  # exactly the bulk's length
    filled: int
    result: Any  # what the reply becomes once complete
    error: BaseException | None = None
    kind: int = 0x24  # '$'; a large '=' or '!' is decoded like a small one once complete


_AGGREGATES = frozenset(b"*%~>|")
_SKIP = object()


class ReplyReader:
    """Resumable RESP2/RESP3 reply parser; see the module docstring.

    ``on_reply(value)`` is called for every complete top-level reply (including pushes), and
    ``out_for_reply()`` is asked for the ``out`` of the reply whose first byte was just parsed.
    """

    def __init__(
        self,
        on_reply: Callable[[Any], None],
        out_for_reply: Callable[[], OutSpec] = lambda: None,
        big: int = BIG_BULK,
        bufsize: int = READ_BUFFER,
    ) -> None:
        self._on_reply = on_reply
        self._out_for_reply = out_for_reply
        self._big = big
        self._buf = bytearray(bufsize)
        self._view = memoryview(self._buf)
        self._pos = 0
        self._end = 0
        self._stack: list[_Frame] = []
        self._out: OutSpec = None
        self._target: _Target | None = None
        self._crlf_after: Any = _SKIP  # a value waiting for the CRLF after its in-place bulk

    def get_buffer(self) -> memoryview:
        """Where the next bytes from the socket should be received."""
        target = self._target
        if target is not None:
            return target.view[target.filled :]
        if self._pos == self._end:
            self._pos = self._end = 0
        elif len(self._buf) - self._end < HEADER_READ:
            self._compact()
        if self._expects_out():
            return self._view[self._end : self._end + HEADER_READ]
        return self._view[self._end :]

    def _expects_out(self) -> bool:
        """The next bulk may be received into a caller's buffer."""
        if not self._stack:
            return self._out_for_reply() is not None
        return len(self._stack) == 1 and isinstance(self._out, list | tuple)

    def buffer_updated(self, nbytes: int) -> None:
        """``nbytes`` arrived in the buffer last returned by :meth:`get_buffer`."""
        target = self._target
        if target is not None:
            target.filled += nbytes
            if target.filled < len(target.view):
                return
            self._finish_target()
        else:
            self._end += nbytes
        self._parse()

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Push bytes through the reader (tests and callers without ``recv_into``)."""
        src = memoryview(data).cast("B")
        while src.nbytes:
            dst = self.get_buffer()
            n = min(dst.nbytes, src.nbytes)
            dst[:n] = src[:n]
            src = src[n:]
            self.buffer_updated(n)

    @property
    def idle(self) -> bool:
        """True when no reply is partly received."""
        return self._pos == self._end and not self._stack and self._target is None

    def _compact(self) -> None:
        live = self._end - self._pos
        if live + 4096 > len(self._buf):  # a long line: grow
            grown = bytearray(max(len(self._buf) * 2, live + 4096))
            grown[:live] = self._view[self._pos : self._end]
            self._buf, self._view = grown, memoryview(grown)
        else:
            self._view[:live] = self._view[self._pos : self._end]
        self._pos, self._end = 0, live

    def _parse(self) -> None:
        buf = self._buf
        while self._target is None:
            if not self._stack and self._crlf_after is _SKIP and _c_parse_reply is not None:
                if self._pos == self._end:
                    return
                if self._out_for_reply() is None:  # a reply to receive in place: below
                    whole = _c_parse_reply(buf, self._pos, self._end, self._big, Simple)
                    if whole is not None:
                        value, self._pos = whole
                        self._out = None
                        self._on_reply(value)
                        continue
            if self._crlf_after is not _SKIP:
                if self._end - self._pos < 2:
                    return
                if buf[self._pos : self._pos + 2] != b"\r\n":
                    raise ProtocolError("bulk not followed by CRLF")
                self._pos += 2
                value, self._crlf_after = self._crlf_after, _SKIP
                self._emit(value)
                continue
            nl = buf.find(b"\r\n", self._pos, self._end)
            if nl < 0:
                if self._end - self._pos > MAX_LINE:
                    raise ProtocolError("reply line too long")
                return
            if not self._item(buf[self._pos], nl):
                return

    def _item(self, kind: int, nl: int) -> bool:
        """Parse one item whose header line ends at ``nl``; False when more bytes are needed."""
        if not self._stack:
            self._out = self._out_for_reply()
        line = bytes(self._buf[self._pos + 1 : nl])
        if kind in (0x24, 0x3D, 0x21):  # $ = !
            return self._bulk(kind, _int(line), nl + 2)
        self._pos = nl + 2
        if kind in _AGGREGATES:
            n = _int(line)
            if n < 0:
                self._emit(None)
            elif n == 0:
                if kind != 0x7C:  # an empty attribute describes nothing
                    self._emit(_empty(kind))
            else:
                self._stack.append(_Frame(kind, 2 * n if kind in (0x25, 0x7C) else n, []))
            return True
        self._emit(_scalar(kind, line))
        return True

    def _bulk(self, kind: int, n: int, start: int) -> bool:
        if n < 0:
            self._pos = start
            self._emit(None)
            return True
        out = self._bulk_out() if kind == 0x24 else None
        if out is None and n < self._big:
            if self._end - start < n + 2:
                return False  # the header is parsed again once the rest arrived
            data = bytes(self._buf[start : start + n])
            if self._buf[start + n : start + n + 2] != b"\r\n":
                raise ProtocolError("bulk not followed by CRLF")
            self._pos = start + n + 2
            self._emit(_bulk_value(kind, data))
            return True
        self._pos = start
        self._start_target(n, out, kind)
        return True

    def _bulk_out(self) -> Any:
        out = self._out
        if out is None:
            return None
        if not self._stack:
            return None if isinstance(out, list | tuple) else out
        if len(self._stack) == 1 and isinstance(out, list | tuple):
            index = len(self._stack[0].items)
            return out[index] if index < len(out) else None
        return None

    def _start_target(self, n: int, out: Any, kind: int = 0x24) -> None:
        error: BaseException | None = None
        view: memoryview | None = None
        result: Any = None
        if out is not None:
            whole = as_writable_view(out)
            if whole.nbytes >= n:
                view = result = whole[:n]
            else:
                error = BufferTooSmall(
                    f"reply of {n} bytes does not fit a buffer of {whole.nbytes}"
                )
        if view is None:
            result = bytearray(n)
            view = memoryview(result)
        take = min(n, self._end - self._pos)
        view[:take] = self._view[self._pos : self._pos + take]
        self._pos += take
        self._target = _Target(view, take, result, error, kind)
        if take == n:
            self._finish_target()

    def _finish_target(self) -> None:
        target = self._target
        assert target is not None
        self._target = None
        if target.error is not None:
            self._crlf_after = target.error
        elif target.kind != 0x24:  # a large verbatim string or blob error
            self._crlf_after = _bulk_value(target.kind, bytes(target.result))
        else:
            self._crlf_after = target.result

    def _emit(self, value: Any) -> None:
        stack = self._stack
        while stack:
            frame = stack[-1]
            frame.items.append(value)
            frame.need -= 1
            if frame.need:
                return
            stack.pop()
            value = _finish(frame)
            if value is _SKIP:  # an attribute: it precedes the value it describes
                return
        self._out = None
        self._on_reply(value)


def _int(line: bytes) -> int:
    try:
        return int(line)
    except ValueError:
        raise ProtocolError(f"invalid length or integer {line[:32]!r}") from None


def _scalar(kind: int, line: bytes) -> Any:
    if kind == 0x2B:  # +
        return Simple(line)
    if kind == 0x2D:  # -
        return error_from_reply(line)
    if kind in (0x3A, 0x28):  # : (
        return _int(line)
    if kind == 0x5F:  # _
        return None
    if kind == 0x23:  # #
        if line not in (b"t", b"f"):
            raise ProtocolError(f"invalid boolean {line[:8]!r}")
        return line == b"t"
    if kind == 0x2C:  # ,
        try:
            return float(line)
        except ValueError:
            raise ProtocolError(f"invalid double {line[:32]!r}") from None
    raise ProtocolError(f"unknown reply type {chr(kind)!r}")


def _bulk_value(kind: int, data: bytes) -> Any:
    if kind == 0x21:  # ! blob error
        return error_from_reply(data)
    if kind == 0x3D:  # = verbatim: "txt:" prefix
        return data[4:] if data[3:4] == b":" else data
    return data


def _empty(kind: int) -> Any:
    if kind in (0x25,):
        return {}
    if kind == 0x3E:
        return Push()
    return []


def _finish(frame: _Frame) -> Any:
    items = frame.items
    kind = frame.kind
    if kind == 0x25:  # %
        return {_hashable(items[i]): items[i + 1] for i in range(0, len(items), 2)}
    if kind == 0x7C:  # | attribute
        return _SKIP
    if kind == 0x3E:  # >
        return Push(items)
    return items


def _hashable(key: Any) -> Any:
    if isinstance(key, list):
        return tuple(_hashable(k) for k in key)
    if isinstance(key, bytearray):
        return bytes(key)
    return key
