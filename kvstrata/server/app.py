"""The server: listeners, the client table, periodic work and graceful shutdown.

``Server.run()`` starts everything and returns after shutdown (SIGTERM/SIGINT, ``SHUTDOWN``,
or :meth:`Server.request_shutdown`). Start-up binds the listeners first (:meth:`Server.listen`)
and then builds the store (:meth:`Server.load`: the tiers, the NVMe index rebuild); meanwhile
``loading`` is true and commands without Redis's ``loading`` flag (everything but PING, INFO,
AUTH, HELLO, CLIENT, CONFIG, COMMAND…) get ``-LOADING``. The DRAM arena's warm-up is not part
of loading: it runs in the background while the store serves (``kvstrata.tiers.dram``).
Shutdown closes the listeners, lets in-flight commands finish within ``shutdown-timeout``
seconds, closes the connections, then the store — after writing the chunks only memory tiers
hold to NVMe within another ``shutdown-timeout`` seconds, unless it was ``SHUTDOWN NOSAVE``.
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
from typing import TYPE_CHECKING, Any

from kvstrata.config import Config, ConfigError
from kvstrata.datadir import FolderLock, lock_folders
from kvstrata.server import fastpath
from kvstrata.server.cmdstats import CommandStats
from kvstrata.server.connection import Connection
from kvstrata.server.context import ClientState, ServerStats
from kvstrata.server.registry import load_all
from kvstrata.server.trace import TraceRecorder
from kvstrata.store.keyspace import Keyspace
from kvstrata.store.strings import StringStore

if TYPE_CHECKING:
    from kvstrata.store.kvstore import KVStore

log = logging.getLogger("kvstrata.server")

CRON_INTERVAL = 0.1


class Server:
    def __init__(self, config: Config, config_file: str = "") -> None:
        self.config = config
        self.config_file = config_file
        self.keyspace = Keyspace()
        self.strings = StringStore(self.keyspace, config)
        self.store: KVStore | None = None
        self.registry = load_all()
        self.clients: dict[int, Connection] = {}
        self.stats = ServerStats()
        self.cmdstats = CommandStats()
        self.monitors: set[Connection] = set()
        self.start_time = time.time()
        self.run_id = secrets.token_hex(20)
        self.port = 0
        self.tls_port = 0
        self.slowlog = _make_slowlog(config)
        #: exact command name → spec, for plain commands (the dispatcher's first look-up)
        self.fast_specs: dict[bytes, Any] = _fast_specs(self.registry)
        #: the compiled small-command path (kvstrata.server.fastpath), None without it
        self.fastpath: Any = fastpath.bind(self)
        self._next_id = 0
        self._servers: list[asyncio.AbstractServer] = []
        self._shutdown = asyncio.Event()
        self._save_on_shutdown = True
        self._listening = asyncio.Event()
        self.metrics: Any = None  # the /metrics endpoint when metrics-port is set
        self._ready = asyncio.Event()
        #: true from the moment the port is bound until the store is ready (INFO loading:1)
        self.loading = False
        self.loading_start_time = 0.0
        self._cron: asyncio.Task[None] | None = None
        #: ``trace-file``: the KV command recorder (kvstrata.tracefile), None when off
        self.tracer: TraceRecorder | None = None
        #: ``kv-events-endpoint``: the KV-event publisher (kvstrata.server.events), None when off
        self.events: Any = None
        #: the data folder's lock (and the NVMe folder's), held from listen() to shutdown()
        self._folder_locks: list[FolderLock] = []

    # -- life cycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Open the listeners, start periodic work, then build the store."""
        await self.listen()
        await self.load()

    async def listen(self) -> None:
        """Lock the data folder (``datadir``: a second server on it stops here), bind the
        listeners (``loading`` until :meth:`load` is done) and start periodic work."""
        nvme = self.config.nvme_dir if self.config.nvme_capacity else None
        self._folder_locks = lock_folders(self.config.data_dir, nvme)
        try:
            await self._listen()
        except BaseException:
            self._release_folders()
            raise

    def _release_folders(self) -> None:
        for lock in self._folder_locks:
            lock.release()
        self._folder_locks = []

    async def _listen(self) -> None:
        tls_context = self._ssl_context() if self.config.tls_port else None
        self.loading = True
        self.loading_start_time = time.time()
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
                ssl=tls_context, reuse_address=True,
            )  # fmt: skip
            self._servers.append(tls)
            self.tls_port = tls.sockets[0].getsockname()[1]
            self.config.values["tls-port"] = self.tls_port
        await self._start_metrics(hosts[0] or "0.0.0.0")
        self._start_events()
        self._cron = asyncio.ensure_future(self._cron_loop())
        self._listening.set()

    async def _start_metrics(self, host: str) -> None:
        if not self.config.metrics_port:
            return
        from kvstrata.server.metrics import INSTALL_HINT, MetricsEndpoint, metrics_available

        if not metrics_available():
            raise ConfigError(INSTALL_HINT)
        self.metrics = MetricsEndpoint(self)
        await self.metrics.start(host, self.config.metrics_port)
        self.cmdstats.histograms = True
        log.info("Prometheus metrics on http://%s:%d/metrics", host, self.metrics.port)

    def _start_events(self) -> None:
        if not self.config.kv_events_endpoint:
            return
        from kvstrata.server.events import ZmqPublisher, node_name

        self.events = ZmqPublisher(self.config, node_name(self.config, self.port))
        self.events.start()

    async def load(self) -> None:
        """Build the store (tiers, index rebuild); then commands are no longer refused (the DRAM
        arena goes on warming in the background)."""
        self.store = await _build_store(self.config, self.keyspace, self.events)
        if self.store is not None:
            self.store.state.tracer = self.tracer  # the store records what changes placement
        self.strings.kv = self.store  # large plain values live in its tiers
        fastpath.bind_store(self)  # KV.MATCH / KV.MGET on the compiled path
        self.loading = False
        self._ready.set()

    def _ssl_context(self) -> ssl.SSLContext:
        """The TLS listener's context; ConfigError naming the key whose file is unusable
        (start-up stops with that message instead of refusing every client later)."""
        cfg = self.config
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"invalid value for 'tls-cert-file'/'tls-key-file': cannot load "
                f"{cfg.tls_cert_file} with {cfg.tls_key_file}: {_reason(exc)}"
            ) from None
        if cfg.tls_ca_cert_file:
            try:
                ctx.load_verify_locations(cfg.tls_ca_cert_file)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(
                    f"invalid value for 'tls-ca-cert-file': cannot load "
                    f"{cfg.tls_ca_cert_file}: {_reason(exc)}"
                ) from None
        ctx.verify_mode = {
            "yes": ssl.CERT_REQUIRED,
            "optional": ssl.CERT_OPTIONAL,
            "no": ssl.CERT_NONE,
        }[cfg.tls_auth_clients]
        return ctx

    async def run(self, install_signals: bool = False) -> None:
        """Listen, load, serve until shutdown is requested, then shut down. A shutdown asked
        for while loading stops the loading; a failed loading closes the listeners and
        raises."""
        await self.listen()
        if install_signals:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_shutdown)
        loader = asyncio.ensure_future(self.load())
        stop = asyncio.ensure_future(self._shutdown.wait())
        await asyncio.wait([loader, stop], return_when=asyncio.FIRST_COMPLETED)
        if not loader.done():
            loader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loader
            log.info("shutdown requested while loading")
        elif loader.exception() is not None:
            stop.cancel()
            await self.shutdown()
            loader.result()  # raises the loading error
        await stop
        await self.shutdown()

    def request_shutdown(self, save: bool = True) -> None:
        """Stop the server; ``save=False`` (SHUTDOWN NOSAVE) skips writing memory to NVMe."""
        if not self._shutdown.is_set():
            self._save_on_shutdown = save
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
        if self.metrics is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.metrics.close(), 1.0)
        if self.store is not None:
            await self.store.close(save_budget=self._save_budget())
        if self.tracer is not None:
            self.tracer.close()
        if self.events is not None:
            if self.store is not None and self.store.events is not None:
                self.store.events.flush()  # the last tick's events still go out
            self.events.close()
        self._release_folders()  # last: the store no longer writes there
        log.info("kvstrata stopped")

    def _save_budget(self) -> float | None:
        """Seconds the store may spend writing memory-only chunks to NVMe; None: no save."""
        if not self._save_on_shutdown:
            log.info("shutdown: NOSAVE, chunks held only in memory are not written to NVMe")
            return None
        return float(self.config.shutdown_timeout)

    @property
    def stopping(self) -> bool:
        """A shutdown was requested."""
        return self._shutdown.is_set()

    async def wait_ready(self) -> None:
        """Until the store is built and commands are served (after :meth:`wait_listening`)."""
        await self._ready.wait()

    async def wait_listening(self) -> None:
        """Until the port is bound (PING answers; most commands get -LOADING until ready)."""
        await self._listening.wait()

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
                    self._clients_cron()
            except Exception:
                log.exception("periodic task failed")

    def _clients_cron(self) -> None:
        """Per-client limits that no event trips (output soft limit, payload-timeout)."""
        now = time.monotonic()
        for conn in list(self.clients.values()):
            conn.cron(now)

    def _close_idle_clients(self) -> None:
        timeout = self.config.timeout
        if not timeout:
            return
        for conn in list(self.clients.values()):
            if conn.idle_seconds > timeout and not conn.busy and conn not in self.monitors:
                log.debug("closing idle client %s", conn.client.addr)
                conn.kill()


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return str(exc.reason or exc)
    return str(getattr(exc, "strerror", None) or exc)


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


def _import_store(config: Config) -> None:
    """Import the store and the modules of the configured tiers (numpy, boto3…): run on a
    worker thread so that the event loop keeps answering PING meanwhile."""
    import importlib

    from kvstrata.store.kvstore.build import tier_modules

    importlib.import_module("kvstrata.store.kvstore")
    for module in tier_modules(config):
        importlib.import_module(module)


async def _build_store(config: Config, keyspace: Keyspace, events: Any = None) -> Any:
    try:
        await asyncio.get_running_loop().run_in_executor(None, _import_store, config)
        from kvstrata.store.kvstore import KVStore
    except ImportError:
        log.warning("KV store not available: KV.* commands are disabled")
        return None
    store = await KVStore.from_config(config, keyspace, events)
    try:
        await store.start()
    except BaseException:  # cancelled (shutdown while loading) or failed: close the tiers
        await store.close()
        raise
    return store
