"""``scripts/gpu-check.sh`` on a CPU machine: its dry run goes through every step, and a step
that fails is reported while the steps after it still run (no ``set -e`` abort)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("machine", "kvikio", "paths", "ipc-tests", "pinning", "tier-tests", "benchmark")


def run_check(out: Path, python: str = sys.executable) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": python, "PYTHONPATH": str(ROOT), "OUT": str(out)}
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--dry-run", str(out)],
        capture_output=True, text=True, timeout=880, env=env, cwd=ROOT,
    )  # fmt: skip


@pytest.mark.timeout(900)  # ~15 s alone; each step starts Pythons that import torch
def test_dry_run_goes_through_every_step(tmp_path: Path) -> None:
    proc = run_check(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in summary] == list(STEPS)
    assert all(": ran (" in line for line in summary), summary
    out = proc.stdout
    assert "probe paths server=cudart client=torch: skipped (dry run)" in out
    assert "probe paths server=cupy client=cupy: skipped (dry run)" in out
    assert "probe pin: skipped" in out
    assert "needs CUDA" in (tmp_path / "ipc-tests.log").read_text()  # collected, skipped
    assert "NVMe→GPU load_from_nvme" in (tmp_path / "benchmark.log").read_text()
    assert (tmp_path / "gpu-bench.json").exists()


@pytest.mark.timeout(600)
def test_a_failing_step_is_reported_and_the_rest_still_run(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\n"
        'case "$*" in *gpu_probe.py\\ paths*) echo "probe crashed" >&2; exit 3;; esac\n'
        # the slow steps are stood in for: what is checked is that they are still started
        'case "$*" in *pytest*|*gpu_check.py*) echo "stand-in ran"; exit 0;; esac\n'
        f'exec "{sys.executable}" "$@"\n'
    )
    fake.chmod(0o755)
    out = tmp_path / "out"
    proc = run_check(out, str(fake))
    assert proc.returncode == 1, proc.stdout[-3000:]
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[2].startswith("paths: FAILED (status 3"), summary
    assert [line.split(":")[0] for line in summary] == list(STEPS)
    assert all(": ran (" in line for i, line in enumerate(summary) if i != 2), summary
    assert "stand-in ran" in (out / "benchmark.log").read_text()
