"""Prometheus metrics: ``GET /metrics`` on ``metrics-port`` (off by default), in the text format.

Needs the optional ``metrics`` extra (``prometheus-client``). The endpoint is a small asyncio
HTTP responder on the server's event loop (no thread): each scrape runs :class:`Collector`
there, so it reads the store's counters between commands, never while they change. It listens
on the first address of ``bind``. Families (all prefixed ``kvstrata_``; ``_total`` counters):

- per tier (label ``tier``): ``tier_capacity_bytes``, ``tier_used_bytes``, ``tier_chunks``,
  ``tier_hits``, ``tier_misses``, ``tier_promotions``, ``tier_demotions``, ``tier_evictions``,
  ``tier_read_bytes``, ``tier_written_bytes``, ``tier_errors``, ``tier_integrity_errors``;
- ``chunks``, ``leases``, ``leases_expired``; ``prefetch_queue``, ``prefetch_running``,
  ``prefetch_requests``, ``prefetch_done``, ``prefetch_late``, ``prefetch_dropped``,
  ``prefetch_cancelled``, ``prefetch_errors``;
- ``s3_errors``, ``s3_breaker_open`` (1 while the breaker refuses requests), ``s3_breaker_trips``;
- ``commands`` / ``command_failed`` / ``command_rejected`` and the histogram
  ``command_duration_seconds`` (label ``command``), ``error_replies`` (label ``prefix``);
- ``connected_clients``, ``connections_received``, ``loading``, ``uptime_seconds``,
  ``build_info`` (label ``version``).

``GET /tiermatch?ns=NAMESPACE&hashes=HEX,HEX…`` (or ``&tokens=1,2,3[&chunk=N]``) answers
KV.TIERMATCH as JSON (hashes in hex), for routers that poll over HTTP.

The Grafana dashboard in ``deploy/grafana/`` uses these names; ``tests/test_ops_metrics.py``
checks it against what ``/metrics`` exposes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

from kvstrata import __version__
from kvstrata.server.cmdstats import LATENCY_BUCKETS

if TYPE_CHECKING:
    from kvstrata.server.app import Server

log = logging.getLogger("kvstrata.metrics")

INSTALL_HINT = (
    "--metrics-port needs the 'metrics' extra: python3 -m pip install 'kvstrata[metrics]'"
)

#: (metric suffix, KV.STATS field, kind, help) for every tier
_TIER_FIELDS = (
    ("tier_capacity_bytes", "capacity", "gauge", "Capacity of the tier in bytes."),
    ("tier_used_bytes", "used", "gauge", "Bytes the tier uses."),
    ("tier_chunks", "chunks", "gauge", "Chunks resident in the tier."),
    ("tier_hits", "hits", "counter", "Reads served by the tier."),
    ("tier_misses", "misses", "counter", "Reads the tier could not serve."),
    ("tier_promotions", "promotions", "counter", "Chunks promoted out of the tier."),
    ("tier_demotions", "demotions", "counter", "Chunks demoted from the tier to a lower one."),
    ("tier_evictions", "evictions", "counter", "Chunks dropped from the tier (no copy left)."),
    ("tier_read_bytes", "bytes_out", "counter", "Bytes read out of the tier."),
    ("tier_written_bytes", "bytes_in", "counter", "Bytes written into the tier."),
    ("tier_errors", "errors", "counter", "Failed operations on the tier."),
    ("tier_integrity_errors", "integrity_errors", "counter", "Checksum mismatches found."),
)
_PREFETCH_FIELDS = (
    ("prefetch_queue", "prefetch_queued", "gauge", "Prefetch requests waiting."),
    ("prefetch_running", "prefetch_running", "gauge", "Chunk promotions running."),
    ("prefetch_requests", "prefetch_requests", "counter", "Prefetch requests accepted."),
    ("prefetch_done", "prefetch_done", "counter", "Prefetch requests completed in time."),
    ("prefetch_late", "prefetch_late", "counter", "Prefetch requests past their deadline."),
    ("prefetch_dropped", "prefetch_dropped", "counter", "Requests dropped (queue full)."),
    ("prefetch_cancelled", "prefetch_cancelled", "counter", "Requests cancelled."),
    ("prefetch_errors", "prefetch_errors", "counter", "Prefetch moves that failed."),
)


class Collector:
    """A prometheus_client collector reading the server's state (on its event loop)."""

    def __init__(self, server: Server) -> None:
        self.server = server

    def describe(self) -> list[Any]:
        return []  # do not collect at registration time

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        def family(name: str, kind: str, doc: str, labels: list[str] | None = None) -> Any:
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            return cls(f"kvstrata_{name}", doc, labels=labels)

        srv = self.server
        yield from self._server_families(family)
        commands = family("commands", "counter", "Commands executed.", ["command"])
        failed = family("command_failed", "counter", "Commands that replied an error.",
                        ["command"])  # fmt: skip
        rejected = family("command_rejected", "counter", "Commands refused before running.",
                          ["command"])  # fmt: skip
        latency = HistogramMetricFamily(
            "kvstrata_command_duration_seconds", "Time spent executing commands.",
            labels=["command"],
        )  # fmt: skip
        bounds = [*(repr(b) for b in LATENCY_BUCKETS), "+Inf"]
        for stat in list(srv.cmdstats.commands.values()):
            commands.add_metric([stat.name], stat.calls)
            failed.add_metric([stat.name], stat.failed)
            rejected.add_metric([stat.name], stat.rejected)
            cumulative, running = [], 0
            for bound, count in zip(bounds, stat.buckets, strict=True):
                running += count
                cumulative.append((bound, running))
            latency.add_metric([stat.name], cumulative, stat.seconds)
        errors = family("error_replies", "counter", "Error replies by prefix.", ["prefix"])
        for prefix, count in srv.cmdstats.errors.items():
            errors.add_metric([prefix], count)
        yield from (commands, failed, rejected, latency, errors)
        if srv.store is not None:
            yield from self._store_families(family, srv.store)

    def _server_families(self, family: Any) -> Iterator[Any]:
        srv = self.server
        for name, kind, doc, value in (
            ("connected_clients", "gauge", "Clients connected.", len(srv.clients)),
            ("connections_received", "counter", "Connections accepted.",
             srv.stats.total_connections_received),
            ("loading", "gauge", "1 while the server prepares its tiers.", int(srv.loading)),
            ("uptime_seconds", "gauge", "Seconds since start.", time.time() - srv.start_time),
        ):  # fmt: skip
            metric = family(name, kind, doc)
            metric.add_metric([], value)
            yield metric
        info = family("build_info", "gauge", "kvstrata's version.", ["version"])
        info.add_metric([__version__], 1)
        yield info

    def _store_families(self, family: Any, store: Any) -> Iterator[Any]:
        rows = store.stats()
        for name, field, kind, doc in _TIER_FIELDS:
            metric = family(name, kind, doc, ["tier"])
            for tier, row in rows.items():
                if isinstance(row.get(field), int | float):
                    metric.add_metric([tier], row[field])
            yield metric
        sections = store.info_sections()  # the INFO fields, by section
        info = {k: v for fields in sections.values() for k, v in fields}
        for name, field, kind, doc in (
            ("chunks", "kv_chunks", "gauge", "Chunks in the index."),
            ("leases", "kv_leases", "gauge", "Leases held."),
            ("leases_expired", "kv_leases_expired", "counter", "Leases ended by their TTL."),
            *_PREFETCH_FIELDS,
        ):
            metric = family(name, kind, doc)
            metric.add_metric([], info.get(field, 0))
            yield metric
        yield from _s3_families(family, rows.get("s3"), info)


def _s3_families(family: Any, row: dict[str, Any] | None, remote: dict[str, Any]) -> Iterator[Any]:
    if row is None:
        return
    errors = family("s3_errors", "counter", "Failed S3 requests (tier and lookups).")
    errors.add_metric([], int(row.get("errors", 0)) + int(remote.get("remote_errors", 0)))
    breaker = family("s3_breaker_open", "gauge", "1 while the S3 breaker refuses requests.")
    breaker.add_metric([], 1 if row.get("breaker") == "open" else 0)
    trips = family("s3_breaker_trips", "counter", "Times the S3 breaker opened.")
    trips.add_metric([], int(row.get("breaker_trips", 0)))
    yield from (errors, breaker, trips)


class MetricsEndpoint:
    """``GET /metrics`` over a minimal HTTP/1.1 responder (one request per connection)."""

    def __init__(self, server: Server) -> None:
        from prometheus_client import CollectorRegistry
        from prometheus_client.process_collector import ProcessCollector

        self.server = server
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(cast(Any, Collector(server)))
        ProcessCollector(namespace="kvstrata", registry=self.registry)
        self._server: asyncio.AbstractServer | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._handle, host, port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            method, path = [*head.split(b"\r\n", 1)[0].split(b" "), b"", b""][:2]
            if method not in (b"GET", b"HEAD"):
                status, ctype, body = b"405 Method Not Allowed", b"text/plain", b"GET only\n"
            elif path.split(b"?")[0] == b"/tiermatch":
                status, ctype, body = await self._tiermatch(path)
            elif path.split(b"?")[0] not in (b"/metrics", b"/"):
                status, ctype, body = b"404 Not Found", b"text/plain", b"try /metrics\n"
            else:
                status, ctype = b"200 OK", CONTENT_TYPE_LATEST.encode()
                body = generate_latest(self.registry)
            writer.write(
                b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close"
                b"\r\n\r\n" % (status, ctype, len(body))
            )
            if method != b"HEAD":
                writer.write(body)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            pass
        except ConnectionError:
            pass
        except Exception:
            log.exception("metrics request failed")
        finally:
            writer.close()


    async def _tiermatch(self, path: bytes) -> tuple[bytes, bytes, bytes]:
        from kvstrata.server.commands.kv_route import tier_match_query

        try:
            status, reply = b"200 OK", await tier_match_query(self.server, path)
        except ValueError as exc:
            status, reply = b"400 Bad Request", {"error": str(exc)}
        return status, b"application/json", json.dumps(reply).encode() + b"\n"


def metrics_available() -> bool:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True
