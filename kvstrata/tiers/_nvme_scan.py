"""Rebuilding the NVMe tier's index from its folder: headers only, quarantining what is bad.

Runs on the tier's thread pool, one shard folder (``00``…``ff``) per task. For every file it
reads the 4096-byte header and the size, never the payload. Stale temporary files (a write cut
short by a crash) are removed; foreign, truncated, misplaced or corrupt-header files are moved to
``quarantine/`` (never deleted: a person may want to look at them).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvstrata.chunks import ChunkMeta
from kvstrata.tiers._nvme_format import (
    HEADER_SIZE,
    SUFFIX,
    TMP_SUFFIX,
    BadHeader,
    chunk_digest,
    decode_header,
)

log = logging.getLogger(__name__)
QUARANTINE = "quarantine"


@dataclass(frozen=True, slots=True)
class RebuildReport:
    """What the last ``scan()`` found (INFO persistence)."""

    chunks: int
    bytes: int
    seconds: float
    quarantined: int
    temp_removed: int
    slots_invalid: int = 0  # slab slots whose header failed its checks (torn writes), freed
    stale: int = 0  # older copies of a chunk found beside a newer one, dropped


@dataclass(slots=True)
class ShardResult:
    found: list[tuple[ChunkMeta, int]] = field(default_factory=list)  # (meta, written_ns)
    quarantined: int = 0
    temp_removed: int = 0


def quarantine(root: str, path: str, reason: str) -> bool:
    """Move ``path`` into ``root/quarantine``; False if it was already gone."""
    dest = os.path.join(root, QUARANTINE, f"{os.path.basename(path)}.{time.time_ns()}")
    try:
        os.replace(path, dest)
    except FileNotFoundError:
        return False
    log.warning("nvme: quarantined %s (%s) as %s", path, reason, dest)
    return True


def check_file(path: str, name: str) -> tuple[ChunkMeta, int] | str:
    """(meta, written_ns) of a complete chunk file, or why it is not one."""
    if not name.endswith(SUFFIX) or len(name) != 64 + len(SUFFIX):
        return "foreign file name"
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        block = os.pread(fd, HEADER_SIZE, 0)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    try:
        header = decode_header(block)
    except BadHeader as exc:
        return str(exc)
    if chunk_digest(header.meta.key) != name[: -len(SUFFIX)]:
        return "header names another chunk"
    if size < HEADER_SIZE + header.meta.size:
        return f"truncated ({size} of {HEADER_SIZE + header.meta.size} bytes)"
    return header.meta, header.written_ns


def scan_shard(root: str, shard: str, in_flight: Collection[str]) -> ShardResult:
    """Check every file of one shard folder; ``in_flight`` names temp files being written."""
    result = ShardResult()
    folder = os.path.join(root, shard)
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return result
    for entry in entries:
        if entry.name.endswith(TMP_SUFFIX):
            if entry.path not in in_flight:
                _remove(entry.path)
                result.temp_removed += 1
            continue
        if not entry.is_file(follow_symlinks=False):
            log.warning("nvme: ignoring %s (not a regular file)", entry.path)
            continue
        try:
            checked = check_file(entry.path, entry.name)
        except OSError as exc:
            checked = f"unreadable: {exc.strerror}"
        if isinstance(checked, str):
            result.quarantined += quarantine(root, entry.path, checked)
        else:
            result.found.append(checked)
    return result


def scan_all(
    root: str, shards: list[str], in_flight: Collection[str], threads: int, keep: Collection[str]
) -> tuple[list[ShardResult], int]:
    """Every shard folder on a short-lived pool of ``threads``, then the root folder (files
    named in ``keep`` stay); the shard results and how many root files were quarantined."""
    with ThreadPoolExecutor(threads, thread_name_prefix="kvstrata-nvme-scan") as pool:
        results = list(pool.map(lambda shard: scan_shard(root, shard, in_flight), shards))
    return results, scan_root(root, keep.__contains__)


def scan_root(root: str, keep: Callable[[str], bool]) -> int:
    """Quarantine regular files lying in the tier folder itself; returns how many."""
    moved = 0
    for entry in os.scandir(root):
        if entry.is_file(follow_symlinks=False) and not keep(entry.name):
            moved += quarantine(root, entry.path, "foreign file")
    return moved


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
