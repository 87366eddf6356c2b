"""Error types that carry Redis's reply prefixes.

A command error is raised as a :class:`RespError` subclass and becomes an error reply
(``-PREFIX message``) on the wire; the connection stays open. Only :class:`ProtocolError`
closes the connection. Clients map error replies back to the same classes by their first
word (:func:`error_from_reply`).
"""

from __future__ import annotations


class RespError(Exception):
    """An error reply: ``-{prefix} {message}``."""

    prefix = "ERR"

    def __init__(self, message: str, prefix: str | None = None) -> None:
        super().__init__(message)
        if prefix is not None:
            self.prefix = prefix
        self.message = message

    def reply_line(self) -> bytes:
        """The error as it goes on the wire, without the leading ``-`` and trailing CRLF."""
        text = f"{self.prefix} {self.message}" if self.message else self.prefix
        return text.replace("\r", " ").replace("\n", " ").encode("utf-8", "replace")

    def __str__(self) -> str:
        return f"{self.prefix} {self.message}"


class CommandError(RespError):
    """Generic ``ERR`` reply."""

    prefix = "ERR"


class WrongTypeError(RespError):
    prefix = "WRONGTYPE"


class NoAuthError(RespError):
    prefix = "NOAUTH"


class WrongPassError(RespError):
    prefix = "WRONGPASS"


class NoPermError(RespError):
    prefix = "NOPERM"


class OutOfMemoryError(RespError):
    """``OOM``: the chunk cannot be placed in any tier."""

    prefix = "OOM"


class DeniedError(RespError):
    """Protected mode refuses a remote client."""

    prefix = "DENIED"


class BusyError(RespError):
    prefix = "BUSY"


class NoProtoError(RespError):
    prefix = "NOPROTO"


class LoadingError(RespError):
    """``LOADING``: the server is still preparing its tiers (clients retry, as with Redis)."""

    prefix = "LOADING"

    def __init__(self, message: str = "kvstrata is loading the dataset in memory") -> None:
        super().__init__(message)


class LeaseError(RespError):
    """``NOLEASE``: the lease id is unknown, expired or of the wrong kind."""

    prefix = "NOLEASE"


class LeaseLimitError(RespError):
    """Too many leases (per connection or in total), or too many bytes fenced for one
    connection by its expired leases (``lease-*`` limits)."""

    prefix = "LEASELIMIT"


class ProtocolError(RespError):
    """Malformed input: the server replies ``-ERR Protocol error: …`` and closes the connection."""

    prefix = "ERR"

    def __init__(self, message: str) -> None:
        super().__init__(f"Protocol error: {message}")


_BY_PREFIX: dict[str, type[RespError]] = {
    cls.prefix: cls
    for cls in (
        WrongTypeError,
        NoAuthError,
        WrongPassError,
        NoPermError,
        OutOfMemoryError,
        DeniedError,
        BusyError,
        NoProtoError,
        LeaseError,
        LeaseLimitError,
        LoadingError,
    )
}


def error_from_reply(line: bytes | str) -> RespError:
    """Build the exception for an error reply line (without ``-`` and CRLF)."""
    text = line.decode("utf-8", "replace") if isinstance(line, bytes | bytearray) else line
    prefix, _, message = text.partition(" ")
    cls = _BY_PREFIX.get(prefix)
    if cls is not None:
        return cls(message)
    if prefix.isupper() and prefix.isalpha():
        return CommandError(message, prefix=prefix) if prefix != "ERR" else CommandError(message)
    return CommandError(text)


def wrong_arity(name: str) -> CommandError:
    return CommandError(f"wrong number of arguments for '{name.lower()}' command")


def syntax_error() -> CommandError:
    return CommandError("syntax error")


def not_integer() -> CommandError:
    return CommandError("value is not an integer or out of range")
