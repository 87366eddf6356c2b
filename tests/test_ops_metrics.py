"""``/metrics`` (``--metrics-port``): scraped over HTTP and parsed with prometheus_client's own
parser while a workload runs (counters move); the Grafana dashboard only uses names it exposes;
without the ``metrics`` extra the server refuses to start with the install command."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import redis

from tests.conftest import RunningServer, free_port

if TYPE_CHECKING:
    from tests.s3fixture import MotoServer

pytest_plugins = ["tests.s3fixture"]
parser = pytest.importorskip(
    "prometheus_client.parser", reason="prometheus-client (the test and metrics extras)"
)

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "kvstrata.json"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> tuple[Samples, set[str]]:
    """Every sample by (name, labels), and every family name, from one scrape."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain; version=")
        text = reply.read().decode()
    samples: Samples = {}
    families: set[str] = set()
    for family in parser.text_string_to_metric_families(text):
        families.add(family.name)
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, families


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture
def metered(make_server: Callable[..., RunningServer]) -> RunningServer:
    return make_server(metrics_port=free_port(), dram_capacity="8MiB")


def _workload(client: redis.Redis, start: int, n: int) -> None:
    parent = b""
    for i in range(start, start + n):
        h = f"{i:08x}".encode()
        client.execute_command("KV.PUT", "ns", h, parent, bytes([i % 256]) * 1024 * 1024)
        client.execute_command("KV.GET", "ns", h)
        client.execute_command("KV.GET", "ns", b"ff" + h)  # a miss
        parent = h


def test_counters_move_while_a_workload_runs(metered: RunningServer) -> None:
    port = metered.server.metrics.port
    client = redis.Redis(port=metered.port)
    before, _ = scrape(port)
    _workload(client, 0, 12)  # 12 MiB into an 8 MiB DRAM tier: demotions to NVMe
    after, families = scrape(port)
    assert value(after, "kvstrata_commands_total", command="kv.put") == 12
    assert value(after, "kvstrata_commands_total", command="kv.get") == 24
    assert value(after, "kvstrata_command_duration_seconds_count", command="kv.put") == 12
    inf = value(after, "kvstrata_command_duration_seconds_bucket", command="kv.put", le="+Inf")
    assert inf == 12
    assert value(after, "kvstrata_tier_written_bytes_total", tier="dram") >= 12 * 1024 * 1024
    assert value(after, "kvstrata_tier_demotions_total", tier="dram") > 0
    assert value(after, "kvstrata_tier_chunks", tier="nvme") > 0
    assert value(after, "kvstrata_connected_clients") >= 1
    assert value(after, "kvstrata_chunks") == 12
    assert value(after, "kvstrata_loading") == 0
    for tier in ("dram", "nvme"):
        assert value(after, "kvstrata_tier_capacity_bytes", tier=tier) > 0
    grew = [
        key for key, v in after.items()
        if key[0].endswith("_total") and v > before.get(key, 0.0)
    ]  # fmt: skip
    assert len(grew) >= 5
    with pytest.raises(redis.ResponseError):
        client.execute_command("KV.GET", "", "aa")
    third, _ = scrape(port)
    errors = "kvstrata_error_replies_total"
    assert value(third, errors, prefix="ERR") == after.get((errors, (("prefix", "ERR"),)), 0) + 1
    assert value(third, "kvstrata_command_failed_total", command="kv.get") == 1
    assert {"kvstrata_prefetch_queue", "kvstrata_leases", "kvstrata_tier_hits"} <= families


def test_404_for_other_paths(metered: RunningServer) -> None:
    port = metered.server.metrics.port
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/nope", timeout=10)
    assert err.value.code == 404


def _dashboard_metric_names() -> set[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dash["panels"] for t in panel.get("targets", [])]
    assert exprs, "the dashboard has no queries"
    return {name for e in exprs for name in re.findall(r"\bkvstrata_[a-z0-9_]+", e)}


def test_dashboard_uses_only_exposed_metric_names(
    make_server: Callable[..., RunningServer], moto_server: MotoServer, s3_bucket: str
) -> None:
    """With every tier family present (dram, nvme, s3), each name a dashboard query uses is a
    sample name the endpoint exposes (``_bucket``, ``_total`` … included)."""
    srv = make_server(metrics_port=free_port(), s3_endpoint=moto_server.endpoint,
                      s3_bucket=s3_bucket)  # fmt: skip
    redis.Redis(port=srv.port).execute_command("KV.PUT", "ns", "aa", "", b"x" * 100)
    samples, _ = scrape(srv.server.metrics.port)
    exposed = {name for name, _ in samples}
    missing = _dashboard_metric_names() - exposed
    assert not missing, f"dashboard queries names /metrics does not expose: {sorted(missing)}"
    assert value(samples, "kvstrata_s3_breaker_open") == 0
