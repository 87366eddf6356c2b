"""The RESP value model shared by server and clients (one model for RESP2 and RESP3).

Python values map to RESP3 types; the encoder downgrades them for RESP2 connections:

=====================  ==================  =============================
Python                 RESP3               RESP2
=====================  ==================  =============================
bytes/bytearray/view   ``$`` bulk string   same
str                    ``$`` bulk (UTF-8)  same
:class:`Simple`        ``+`` simple        same
int                    ``:`` integer       same
bool                   ``#`` boolean       ``:1`` / ``:0``
float                  ``,`` double        bulk string
None                   ``_`` null          ``$-1``
:data:`NULL_ARRAY`     ``_`` null          ``*-1``
list/tuple             ``*`` array         same
dict                   ``%`` map           flat array of key, value
set/frozenset          ``~`` set           array
:class:`Verbatim`      ``=`` verbatim      bulk string
:class:`Push`          ``>`` push          array
:class:`BulkView`      ``$`` bulk          same (sent without copying)
RespError              ``-`` error         same
=====================  ==================  =============================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


class Simple(bytes):
    """A simple string reply (``+OK``)."""

    __slots__ = ()


OK = Simple(b"OK")
PONG = Simple(b"PONG")
QUEUED = Simple(b"QUEUED")


class _NullArray:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NULL_ARRAY"


NULL_ARRAY = _NullArray()


class _NoReply:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NO_REPLY"


#: returned by a handler that answers nothing (SHUTDOWN closes the connection instead)
NO_REPLY = _NoReply()


@dataclass(frozen=True, slots=True)
class Verbatim:
    """A verbatim string (``=``), e.g. INFO in RESP3 is plain bulk; CLIENT INFO is verbatim."""

    data: bytes
    format: bytes = b"txt"


class Push(list):  # type: ignore[type-arg,unused-ignore]
    """An out-of-band push (``>``)."""

    __slots__ = ()


@dataclass(slots=True)
class BulkView:
    """A large bulk reply sent straight from memory the server owns (an arena slot).

    ``release`` is called once the transport no longer references ``view`` (the bytes were
    handed to the kernel); until then the chunk stays pinned.
    """

    view: memoryview
    release: Callable[[], None] | None = None

    def __len__(self) -> int:
        return self.view.nbytes
