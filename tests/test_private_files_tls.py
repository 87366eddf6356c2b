"""Issue 12, files and TLS: NVMe chunk files and folders are private (0600/0700) whatever the
umask, folders left open by an older version are tightened, and a TLS misconfiguration stops
start-up with a message naming the key instead of refusing every client later."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.tiers.checksum import checksum
from kvstrata.tiers.nvme import NvmeConfig, NvmeTier
from tests.conftest import free_port
from tests.test_server_core import _self_signed


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _put_one(root: Path) -> None:
    """One small chunk (a slab slot) and one over nvme-slab-max (a chunk file)."""
    small, large = b"secret prompt KV" * 300, b"secret prompt KV" * 65_600
    metas = [
        ChunkMeta(ChunkKey("modes@test", bytes([i]) * 32), b"", 1, len(data), checksum(data))
        for i, data in enumerate((small, large))
    ]

    async def main() -> None:
        tier = NvmeTier(NvmeConfig(str(root), capacity=1 << 30, io_threads=1))
        try:
            await tier.put_many(list(zip(metas, (small, large), strict=True)))
        finally:
            await tier.close()

    asyncio.run(main())


def test_nvme_files_and_folders_are_private_under_a_permissive_umask(tmp_path: Path) -> None:
    """Scenario: umask 000 (what a container often has); the tier creates its folder, shard
    folders, a slab file and a chunk file: none is readable by group or others."""
    root = tmp_path / "nvme"
    old = os.umask(0)
    try:
        _put_one(root)
    finally:
        os.umask(old)
    files = [p for p in root.rglob("*") if p.is_file()]
    folders = [root, *(p for p in root.rglob("*") if p.is_dir())]
    assert {p.suffix for p in files} >= {".kvc", ".slab"}
    assert {oct(_mode(p)) for p in files} == {oct(0o600)}
    assert {oct(_mode(p)) for p in folders} == {oct(0o700)}


def test_existing_open_folders_are_tightened(tmp_path: Path) -> None:
    """Scenario: the folder and a shard exist with 0755 (an older version made them)."""
    root = tmp_path / "nvme"
    (root / "01").mkdir(parents=True)
    os.chmod(root, 0o755)
    os.chmod(root / "01", 0o777)
    _put_one(root)
    assert _mode(root) == 0o700
    assert _mode(root / "01") == 0o700


def _serve(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "kvstrata", "serve", "--port", "0",
            "--data-dir", str(tmp_path / "data"), "--dram-capacity", "4MiB",
            "--nvme-capacity", "0", "--tls-port", str(free_port()), *flags]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("auth", ["yes", "optional"])
def test_tls_client_auth_without_ca_stops_startup(tmp_path: Path, auth: str) -> None:
    cert, key = _self_signed(tmp_path)
    proc = _serve(tmp_path, "--tls-cert-file", str(cert), "--tls-key-file", str(key),
                  "--tls-auth-clients", auth)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "configuration error" in proc.stderr
    assert "'tls-auth-clients'" in proc.stderr and "tls-ca-cert-file" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("which", ["cert", "key", "ca"])
def test_unreadable_tls_files_stop_startup_with_the_key_named(tmp_path: Path, which: str) -> None:
    cert, key = _self_signed(tmp_path)
    missing = tmp_path / "missing.pem"
    files = {"cert": cert, "key": key, "ca": cert}
    files[which] = missing
    proc = _serve(tmp_path, "--tls-cert-file", str(files["cert"]), "--tls-key-file",
                  str(files["key"]), "--tls-ca-cert-file", str(files["ca"]),
                  "--tls-auth-clients", "yes")  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    key_named = "'tls-ca-cert-file'" if which == "ca" else "'tls-cert-file'/'tls-key-file'"
    assert key_named in proc.stderr and str(missing) in proc.stderr
    assert "Traceback" not in proc.stderr
