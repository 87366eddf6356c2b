"""Settings of the NVMe tier and the preparation of its folder."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstrata.tiers._nvme_io import probe_writable
from kvstrata.tiers._nvme_slabs import CLASSES
from kvstrata.tiers._nvme_sync import POLICIES
from kvstrata.tiers.base import TierUnavailable

MiB = 1024 * 1024
#: chunk files hold prompts' KV: folders 0700, files 0600 (as the DRAM arena), whatever the umask
PRIVATE_DIR = 0o700


def make_private(folder: Path) -> None:
    """Tighten a folder (new, or left by an older version or another tool) to 0700."""
    mode = folder.stat().st_mode & 0o777
    if mode == PRIVATE_DIR:
        return
    try:
        os.chmod(folder, PRIVATE_DIR)
    except OSError as exc:
        raise TierUnavailable(
            f"nvme-path folder {folder} has mode {mode:o} and cannot be made private "
            f"(0700): {exc.strerror}"
        ) from exc


@dataclass(frozen=True, slots=True)
class NvmeConfig:
    """Settings of the NVMe tier (``nvme-*`` options)."""

    path: str
    capacity: int = 16 * 1024**3
    backend: str = "auto"  # auto | posix | kvikio
    io_threads: int = 4
    write_policy: str = "write-back"  # applied by the store; shown by INFO
    direct: str = "auto"  # POSIX backend: auto | yes | no (O_DIRECT)
    fsync: str = "batch"  # always | batch | never: see _nvme_sync
    slab_max: int = MiB  # chunks up to this size go to slab files (0: none), see _nvme_slabs
    slab_bytes: int = 256 * MiB  # most bytes of one slab file

    def __post_init__(self) -> None:
        if self.fsync not in POLICIES:
            raise ValueError(f"nvme-fsync must be one of {', '.join(POLICIES)}, not {self.fsync!r}")
        if not 0 <= self.slab_max <= CLASSES[-1]:
            raise ValueError(f"nvme-slab-max must be 0-{CLASSES[-1] // MiB}MiB")

    @classmethod
    def from_config(cls, cfg: Any) -> NvmeConfig:
        """Build from a :class:`kvstrata.config.Config`."""
        return cls(
            path=str(cfg.nvme_dir),
            capacity=cfg.nvme_capacity,
            backend=cfg.nvme_backend,
            io_threads=cfg.nvme_io_threads,
            write_policy=cfg.nvme_write_policy,
            fsync=cfg.values.get("nvme-fsync", "batch"),
            slab_max=cfg.values.get("nvme-slab-max", MiB),
        )


def prepare_folder(path: str, subfolders: list[str]) -> None:
    """Create (or check) the tier folder and its subfolders, private; probe that it is
    writable; raises TierUnavailable saying why not."""
    root = Path(path)
    try:
        if not root.is_dir():
            if root.exists():
                raise TierUnavailable(f"nvme-path {root} exists and is not a folder")
            if not root.parent.is_dir():
                raise TierUnavailable(
                    f"nvme-path {root} does not exist, nor does its parent {root.parent}"
                )
            root.mkdir(mode=PRIVATE_DIR)
        make_private(root)
        for sub in subfolders:
            (root / sub).mkdir(mode=PRIVATE_DIR, exist_ok=True)
            make_private(root / sub)
        probe_writable(path)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise TierUnavailable(f"nvme-path {root} is not usable: {exc.strerror}") from exc
