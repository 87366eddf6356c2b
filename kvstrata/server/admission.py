"""Who may connect: ``maxclients`` and protected mode (Redis's rules and wording)."""

from __future__ import annotations

import ipaddress
from typing import Any

from kvstrata.config import Config

MAXCLIENTS = b"-ERR max number of clients reached\r\n"
DENIED = (
    b"-DENIED kvstrata is running in protected mode because protected mode is enabled and no "
    b"password is set for the default user. In this mode connections are only accepted from "
    b"the loopback interface. If you want to connect from external computers to kvstrata you "
    b"may adopt one of the following solutions: 1) Just disable protected mode sending the "
    b"command 'CONFIG SET protected-mode no' from the loopback interface by connecting to "
    b"kvstrata from the same host the server is running, however MAKE SURE kvstrata is not "
    b"publicly accessible from internet if you do so. 2) Alternatively you can just disable the "
    b"protected mode by setting the protected-mode option to 'no' (--protected-mode no), and "
    b"then restarting the server. 3) Set up an authentication password for the default user "
    b"(--requirepass). NOTE: You only need to do one of the above things in order for the "
    b"server to start accepting connections from the outside.\r\n"
)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return host in ("localhost", "") or host.startswith("/")


def refusal(config: Config, clients: int, peer: Any) -> bytes | None:
    """The error line that refuses a new client, or None to admit it."""
    if clients >= config.maxclients:
        return MAXCLIENTS
    host = peer[0] if isinstance(peer, tuple) else str(peer)
    if config.protected_mode and not config.requirepass and not is_loopback(host):
        return DENIED
    return None


def fmt_addr(addr: Any) -> str:
    """``host:port`` as CLIENT LIST shows it (IPv6 in brackets)."""
    if isinstance(addr, tuple) and len(addr) >= 2:
        host = addr[0]
        return f"[{host}]:{addr[1]}" if ":" in host else f"{host}:{addr[1]}"
    return str(addr)
