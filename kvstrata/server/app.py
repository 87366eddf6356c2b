"""The server: listeners, the client table, periodic work and graceful shutdown.

``Server.run()`` starts everything and returns after shutdown (SIGTERM/SIGINT, ``SHUTDOWN``,
or :meth:`Server.request_shutdown`). Shutdown closes the listeners, lets in-flight commands
finish within ``shutdown-timeout`` seconds, closes the connections, then the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import ssl
import time
from pathlib import Path
from typing import Any

from kvstrata.config import Config
from kvstrata.server.connection import Connection
from kvstrata.server.context import ClientState, ServerStats
from kvstrata.server.registry import load_all
from kvstrata.sim.trace import TraceRecorder
from kvstrata.store.keyspace import Keyspace

log = logging.getLogger("kvstrata.server")

CRON_INTERVAL = 0.1


class Server:
    def __init__(self, config: Config, config_file: str = "") -> None:
        self.config = config
        self.config_file = config_file
        self.keyspace = Keyspace()
        self.store: Any = None
        self.registry = load_all()
        self.clients: dict[int, Connection] = {}
        self.stats = ServerStats()
        self.monitors: set[Connection] = set()
        self.start_time = time.time()
        self.run_id = secrets.token_hex(20)
        self.port = 0
        self.tls_port = 0
        self.slowlog = _make_slowlog(config)
        #: exact command name → spec, for plain commands (the dispatcher's first look-up)
        self.fast_specs: dict[bytes, Any] = _fast_specs(self.registry)
        self._next_id = 0
        self._servers: list[asyncio.AbstractServer] = []
        self._shutdown = asyncio.Event()
        self._ready = asyncio.Event()
        self._cron: asyncio.Task[None] | None = None
        #: ``trace-file``: the KV command recorder (kvstrata.sim.trace), None when off
        self.tracer: TraceRecorder | None = None

    # -- life cycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Build the store, open the listeners and start periodic work."""
        _ensure_data_dir(self.config.data_dir)
        self.store = await _build_store(self.config, self.keyspace)
        if self.config.values.get("trace-file"):
            self.tracer = TraceRecorder(self.config.values["trace-file"])
        loop = asyncio.get_running_loop()
        hosts = [h.lstrip("-") for h in self.config.binds]
        hosts = [None if h == "*" else h for h in hosts]  # type: ignore[misc]
        srv = await loop.create_server(
            lambda: Connection(self), host=hosts, port=self.config.port, reuse_address=True,
            backlog=511,
        )  # fmt: skip
        self._servers.append(srv)
        self.port = srv.sockets[0].getsockname()[1]
        self.config.values["port"] = self.port  # CONFIG GET port: the port actually bound
        if self.config.tls_port:
            tls = await loop.create_server(
                lambda: Connection(self), host=hosts, port=self.config.tls_port,
                ssl=self._ssl_context(), reuse_address=True,
            )  # fmt: skip
            self._servers.append(tls)
            self.tls_port = tls.sockets[0].getsockname()[1]
            self.config.values["tls-port"] = self.tls_port
        self._cron = asyncio.ensure_future(self._cron_loop())
        self._ready.set()

    def _ssl_context(self) -> ssl.SSLContext:
        cfg = self.config
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file)
        if cfg.tls_ca_cert_file:
            ctx.load_verify_locations(cfg.tls_ca_cert_file)
        ctx.verify_mode = {
            "yes": ssl.CERT_REQUIRED,
            "optional": ssl.CERT_OPTIONAL,
            "no": ssl.CERT_NONE,
        }[cfg.tls_auth_clients]
        return ctx

    async def run(self, install_signals: bool = False) -> None:
        """Start, serve until shutdown is requested, then shut down."""
        await self.start()
        if install_signals:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_shutdown)
        await self._shutdown.wait()
        await self.shutdown()

    def request_shutdown(self) -> None:
        self._shutdown.set()

    async def shutdown(self) -> None:
        for srv in self._servers:
            srv.close()
        grace = time.monotonic() + self.config.shutdown_timeout
        while any(c.busy for c in self.clients.values()) and time.monotonic() < grace:
            await asyncio.sleep(0.01)
        for conn in list(self.clients.values()):
            conn._flush()
            conn.kill()
        if self._cron is not None:
            self._cron.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._cron
        for srv in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(srv.wait_closed(), 1.0)
        if self.store is not None:
            await self.store.close()
        if self.tracer is not None:
            self.tracer.close()
        log.info("kvstrata stopped")

    async def wait_ready(self) -> None:
        await self._ready.wait()

    # -- helpers for connections and commands ---------------------------------------------
    def next_client_id(self) -> int:
        self._next_id += 1
        return self._next_id

    @property
    def slowlog_threshold(self) -> float:
        """Seconds above which a command goes to the slow log (inf when disabled)."""
        micros = self.config.values["slowlog-log-slower-than"]
        return float("inf") if micros < 0 or self.slowlog is None else micros / 1e6

    def slowlog_record(self, started: float, argv: list[Any], client: ClientState) -> None:
        if self.slowlog is not None:
            self.slowlog.record(int((time.perf_counter() - started) * 1e6), argv, client)

    def feed_monitors(self, source: Connection, argv: list[Any]) -> None:
        try:
            from kvstrata.server.monitor import format_monitor_line
        except ImportError:
            return
        line = format_monitor_line(time.time(), source.client.db, source.client.addr, argv)
        for conn in list(self.monitors):
            if conn is not source:
                conn.send_simple(line)

    def used_memory(self) -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            return 0

    async def _cron_loop(self) -> None:
        ticks = 0
        while True:
            await asyncio.sleep(CRON_INTERVAL)
            ticks += 1
            try:
                self.keyspace.expire_cycle()
                if ticks % 10 == 0:
                    self._close_idle_clients()
            except Exception:
                log.exception("periodic task failed")

    def _close_idle_clients(self) -> None:
        timeout = self.config.timeout
        if not timeout:
            return
        for conn in list(self.clients.values()):
            if conn.idle_seconds > timeout and not conn.busy and conn not in self.monitors:
                log.debug("closing idle client %s", conn.client.addr)
                conn.kill()


def _ensure_data_dir(path: str) -> None:
    """Create the data folder (the embedded default lives there); a clear error otherwise."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(f"cannot create data-dir {folder}: {exc.strerror or exc}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OSError(f"data-dir {folder} is not writable")


def _fast_specs(registry: Any) -> dict[bytes, Any]:
    """Upper, lower and capitalised names of commands without subcommands."""
    table: dict[bytes, Any] = {}
    for spec in registry:
        if spec.subcommands or spec.handler is None:
            continue
        name = spec.name.encode()
        for variant in (name.upper(), name.lower(), name.capitalize()):
            table[variant] = spec
    return table


def _make_slowlog(config: Config) -> Any:
    try:
        from kvstrata.server.slowlog import SlowLog
    except ImportError:
        return None
    return SlowLog(config)


async def _build_store(config: Config, keyspace: Keyspace) -> Any:
    try:
        from kvstrata.store.kvstore import KVStore
    except ImportError:
        log.warning("KV store not available: KV.* commands are disabled")
        return None
    store = await KVStore.from_config(config, keyspace)
    await store.start()
    return store
