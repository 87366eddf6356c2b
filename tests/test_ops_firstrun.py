"""A first run without surprises: ``kvstrata demo`` without the ``hf`` extra says how to install it
in one line (and, without torch, how to get its CPU build first); the demo's embedded server
cannot pick up a ``kvstrata/`` folder from the current directory; ``--metrics-port`` without
prometheus-client names the install; the README's table lists every page under ``docs/``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from kvstrata.demo import EmbeddedServer
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parent.parent


def _run_hiding(module: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """``kvstrata ARGV`` in a child where importing ``module`` fails as if not installed."""
    code = (
        f"import sys; sys.modules[{module!r}] = None; from kvstrata.cli import main; "
        "sys.exit(main(sys.argv[1:]))"
    )
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=120)  # fmt: skip


@pytest.mark.parametrize("module", ["torch", "transformers"])
def test_demo_without_the_hf_extra_prints_one_line_naming_the_install(module: str) -> None:
    """Without torch it also says, before any install starts, how to get torch's CPU build
    (the extra would pull the multi-GB CUDA build): the version the test command pins."""
    proc = _run_hiding(module, "demo", "--turns", "1")
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert f"({module} is not installed)" in lines[0]
    assert "pip install 'kvstrata[hf]'" in lines[0]
    if module == "transformers":
        assert len(lines) == 1, proc.stderr
        return
    assert len(lines) == 3 and "CPU build of torch first" in lines[1], proc.stderr
    cpu = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    assert lines[2].strip() == f"python3 -m {cpu}"
    pinned = (ROOT / "scripts/test.sh").read_text()
    assert '"torch==2.13.0"' in pinned  # the README's and the demo's pin is the test command's
    assert f"python3 -m {cpu}" in (ROOT / "README.md").read_text()


def test_demo_help_works_without_torch() -> None:
    proc = _run_hiding("torch", "demo", "--help")
    assert proc.returncode == 0 and "--turns" in proc.stdout


def test_embedded_server_ignores_a_kvstrata_folder_in_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The clone's parent holds a ``kvstrata/`` folder: ``python -m kvstrata`` run there would
    import it instead of the installed package."""
    decoy = tmp_path / "kvstrata"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise SystemExit('decoy kvstrata package imported')\n")
    (decoy / "__main__.py").write_text("raise SystemExit('decoy kvstrata package imported')\n")
    monkeypatch.chdir(tmp_path)
    with EmbeddedServer(tmp_path / "data", dram_capacity="8MiB") as server:
        assert server.port > 0
        assert redis.Redis(port=server.port).ping()


def test_metrics_port_without_prometheus_client_names_the_install(tmp_path: Path) -> None:
    proc = _run_hiding(
        "prometheus_client", "serve", "--port", "0", "--metrics-port", str(free_port()),
        "--data-dir", str(tmp_path), "--dram-capacity", "8MiB",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'kvstrata[metrics]'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_readme_table_lists_every_doc_page() -> None:
    readme = (ROOT / "README.md").read_text()
    listed = set(re.findall(r"`(docs/[\w.-]+\.md)`", readme))
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert pages - listed == set(), f"add to README's table: {sorted(pages - listed)}"


def test_compose_stack_wires_prometheus_and_grafana_to_the_metrics_port() -> None:
    """docker-compose.yml (also checked by ``docker-compose config -q``): kvstrata serves
    metrics on the port Prometheus scrapes, and every file the stack mounts exists."""
    yaml = pytest.importorskip("yaml", reason="PyYAML reads docker-compose.yml")
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    port = services["kvstrata"]["environment"]["KVSTRATA_METRICS_PORT"]
    scrape = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = [t for job in scrape["scrape_configs"] for c in job["static_configs"]
               for t in c["targets"]]  # fmt: skip
    assert targets == [f"kvstrata:{port}"]
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), source
