"""What a command handler sees: the connection's client state and the server.

Handlers are typed against :class:`Ctx` (a Protocol) so command modules do not import the
connection machinery. ``kvstrata.server.connection.Connection`` implements it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kvstrata.server.app import Server


@dataclass(slots=True)
class ClientState:
    """Per-connection state shown by CLIENT LIST/INFO."""

    id: int
    addr: str
    laddr: str
    created: float = field(default_factory=time.monotonic)
    last_interaction: float = field(default_factory=time.monotonic)
    name: bytes = b""
    lib_name: bytes = b""
    lib_ver: bytes = b""
    protocol: int = 2
    authenticated: bool = False
    user: str = "default"
    db: int = 0
    last_command: str = "NULL"
    flags: set[str] = field(default_factory=set)  # "M" monitor, "P" protected-denied…
    query_buffer: int = 0
    output_buffer: int = 0
    commands: int = 0
    fd: int = -1  # the socket's file descriptor (CLIENT LIST fd=)

    def describe(self, now: float | None = None) -> str:
        """One CLIENT LIST line (Redis's field order, the fields kvstrata tracks)."""
        now = time.monotonic() if now is None else now
        flags = "".join(sorted(self.flags)) or "N"
        return (
            f"id={self.id} addr={self.addr} laddr={self.laddr} fd={self.fd} "
            f"name={self.name.decode('utf-8', 'replace')} "
            f"age={int(now - self.created)} idle={int(now - self.last_interaction)} "
            f"flags={flags} db={self.db} sub=0 psub=0 ssub=0 multi=-1 "
            f"qbuf={self.query_buffer} qbuf-free=0 argv-mem=0 multi-mem=0 "
            f"obl=0 oll=0 omem={self.output_buffer} tot-mem=0 events=r "
            f"cmd={self.last_command.lower()} user={self.user} redir=-1 resp={self.protocol} "
            f"lib-name={self.lib_name.decode('utf-8', 'replace')} "
            f"lib-ver={self.lib_ver.decode('utf-8', 'replace')}"
        )


class PayloadSink(Protocol):
    """Where a large bulk argument is received (e.g. an arena slot for KV.PUT).

    The connection writes the bulk's bytes into ``view`` as they arrive. After the command
    runs, a sink that the handler did not ``consume()`` is ``abort()``-ed (so a failed or
    malformed command never publishes its payload and never leaks its slot).
    """

    view: memoryview

    def consume(self) -> Any: ...

    def abort(self) -> None: ...


class Ctx(Protocol):
    """The handler's view of its connection."""

    server: Server
    client: ClientState
    #: large-bulk sinks of the current command, by argument index
    sinks: dict[int, PayloadSink]

    def close_after_reply(self) -> None:
        """Close the connection once the reply of this command is written (QUIT)."""

    def kill(self) -> None:
        """Close the connection now (CLIENT KILL of another client)."""

    def set_protocol(self, version: int) -> None:
        """Switch replies to RESP2 or RESP3 (HELLO)."""

    def start_monitor(self) -> None:
        """Turn this connection into a MONITOR stream."""

    def stop_monitor(self) -> None:
        """Leave MONITOR mode (RESET)."""

    def send_push(self, value: Any) -> None:
        """Write an out-of-band reply (MONITOR lines)."""


@dataclass(slots=True)
class ServerStats:
    """Counters for INFO stats (reset by CONFIG RESETSTAT)."""

    total_connections_received: int = 0
    total_commands_processed: int = 0
    rejected_connections: int = 0
    total_net_input_bytes: int = 0
    total_net_output_bytes: int = 0
    total_error_replies: int = 0
    protocol_errors: int = 0
    unexpected_errors: int = 0
    output_limit_disconnections: int = 0
    reply_copyouts: int = 0  # times unread replies were copied out of DRAM (reply-pin-max)
    reply_copied_bytes: int = 0
    reply_pin_disconnections: int = 0  # clients closed for pinning DRAM (reply-pin-max)

    def reset(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)
