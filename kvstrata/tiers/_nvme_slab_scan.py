"""Rebuilding the slab part of the NVMe index at start, and reconciling it with chunk files.

Every slab file present when the tier opened is read header by header (4096 bytes per slot,
never a payload): a slot whose chunk header is valid (checksum, ``FLAG_SLOT``, a generation,
a payload that fits the slot) holds a chunk; every other slot — zeroed (free or deleted) or
failing its checksum (a torn write) — is free. A file that is not a slab goes to quarantine.

Two copies of one chunk can be found after a crash (an overwrite cut between writing the new
copy and invalidating the old one; a put of a chunk still held in an old per-chunk file).
:func:`resolve` keeps the newest and names the others, which the tier invalidates (slots) or
removes (files) so they never come back. Two slots are ordered by generation alone (a counter
kept above every generation on disk, so a wall clock that steps back cannot make an older
copy win); the newest slot and a chunk file by write time (``WriteClock``: also kept above
every time found on disk), then slot over file.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Container, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.datadir import LOCK_NAME
from kvstrata.tiers._nvme_files import ChunkFiles
from kvstrata.tiers._nvme_format import FLAG_SLOT, HEADER_SIZE, BadHeader, decode_header
from kvstrata.tiers._nvme_io import _staging
from kvstrata.tiers._nvme_scan import quarantine, scan_all
from kvstrata.tiers._nvme_slabs import SLAB_SUFFIX, Slab, Slabs, SlotRef, decode_slab_header
from kvstrata.tiers._nvme_sync import SYNC_MARKER

log = logging.getLogger(__name__)
WINDOW_SLOT_MAX = 64 * 1024  # slots up to this size are read a window at a time at start


@dataclass(frozen=True, slots=True)
class SlotFound:
    meta: ChunkMeta
    ref: SlotRef
    written_ns: int


@dataclass(slots=True)
class SlabScan:
    """What :func:`scan_slab` found in one slab file."""

    found: list[SlotFound] = field(default_factory=list)
    invalid: int = 0  # slots with a chunk header failing its checks (torn or corrupt)
    quarantined: int = 0  # files that are not slabs


@dataclass(frozen=True, slots=True)
class Resolved:
    """The copies to index and the stale ones to drop (see the module docstring)."""

    files: list[ChunkMeta]
    slots: list[SlotFound]
    stale_slots: list[SlotRef]
    stale_files: list[ChunkKey]


@dataclass(frozen=True, slots=True)
class Rebuilt:
    """What :func:`rebuild` found and kept, and what it dropped."""

    files: list[ChunkMeta]
    slots: list[SlotFound]
    quarantined: int
    temp_removed: int
    slots_invalid: int
    stale: int
    #: chunks whose file lost to a slot: the tier removes the file while the slot is still
    #: the chunk's copy (a put while the rebuild ran may have renamed a new file there)
    stale_files: list[ChunkKey] = field(default_factory=list)


def rebuild(
    files: ChunkFiles,
    slabs: Slabs,
    shards: list[str],
    threads: int,
    known: Container[ChunkKey],
    known_slots: Container[ChunkKey],
) -> Rebuilt:
    """Blocking, at start: scan the chunk files (``_nvme_scan``) and the slab files, keep the
    newest copy of each chunk (:func:`resolve`; ``known``: chunks written since the tier
    opened) and invalidate the stale slots (a failure is logged and the copy loses again at
    the next start); the stale files are named, for the tier to remove."""
    root = files.root
    keep = {".kvstrata-probe", SYNC_MARKER, LOCK_NAME}  # LOCK_NAME: the server's, held
    shard_results, moved = scan_all(root, shards, frozenset(files.in_flight), threads, keep)
    slab_results = scan_slabs(slabs, root, threads)
    found = [item for shard in shard_results for item in shard.found]
    slots = [slot for slab in slab_results for slot in slab.found]
    files.clock.at_least(max([w for _, w in found] + [s.written_ns for s in slots], default=0))
    kept = resolve(found, slots, known, known_slots)
    for ref in kept.stale_slots:
        _quietly(slabs.invalidate, ref)
    return Rebuilt(
        kept.files,
        kept.slots,
        moved
        + sum(s.quarantined for s in shard_results)
        + sum(s.quarantined for s in slab_results),
        sum(s.temp_removed for s in shard_results),
        sum(s.invalid for s in slab_results),
        len(kept.stale_slots) + len(kept.stale_files),
        kept.stale_files,
    )


def _quietly(fn: Callable[[Any], None], arg: Any) -> None:
    try:
        fn(arg)
    except OSError as exc:
        log.warning("nvme: dropping a stale copy at start failed: %s", exc)


def scan_slab(slabs: Slabs, root: str, number: int) -> SlabScan:
    """Read slab file ``number``'s slot headers; adopt it into ``slabs`` with its free slots."""
    result = SlabScan()
    path = os.path.join(slabs.folder, f"{number:06d}{SLAB_SUFFIX}")
    fd = slabs.open(path)
    try:
        stage = _staging()[:HEADER_SIZE]
        got = os.preadv(fd, [stage], 0)
        slot_size, max_slots = decode_slab_header(bytes(stage[:got]))
        size = os.fstat(fd).st_size
    except (OSError, ValueError) as exc:
        os.close(fd)
        result.quarantined += quarantine(root, path, str(exc))
        return result
    grown = min(max_slots, max(0, size - HEADER_SIZE) // slot_size)
    slab = Slab(number, path, fd, slot_size, max_slots, grown, fresh=grown)
    free: list[int] = []
    for slot, block in _headers(fd, slab):
        found = _slot(block, slab, slot)
        if isinstance(found, SlotFound):
            result.found.append(found)
        else:
            free.append(slot)
            result.invalid += found
    free.reverse()  # the allocator pops from the end: lowest slots first
    slabs.adopt(slab, free, max((f.ref.generation for f in result.found), default=0))
    return result


def scan_slabs(slabs: Slabs, root: str, threads: int) -> list[SlabScan]:
    """Every slab file present at start (``slabs.unscanned``), on a short-lived pool."""
    numbers, slabs.unscanned = slabs.unscanned, []
    with ThreadPoolExecutor(threads, thread_name_prefix="kvstrata-nvme-scan") as pool:
        return list(pool.map(lambda n: scan_slab(slabs, root, n), numbers))


def _headers(fd: int, slab: Slab) -> Iterator[tuple[int, bytes]]:
    """(slot, header block) of every slot in the file. Small slots are read a window of
    consecutive slots at a time (one large sequential read beats thousands of 4 KiB ones, and
    the payloads read along cost at most 15× the headers); large ones header by header."""
    stage = _staging()
    per = max(1, len(stage) // slab.slot_size) if slab.slot_size <= WINDOW_SLOT_MAX else 1
    for first in range(0, slab.grown, per):
        n = min(per, slab.grown - first)
        span = stage[: (n - 1) * slab.slot_size + HEADER_SIZE]
        got = os.preadv(fd, [span], slab.offset(first))
        for i in range(n):
            at = i * slab.slot_size
            yield first + i, bytes(span[at : min(got, at + HEADER_SIZE)]) if got > at else b""


def _slot(block: bytes, slab: Slab, slot: int) -> SlotFound | int:
    """The chunk a slot header describes, else 1 for a corrupt header and 0 for a free slot."""
    try:
        header = decode_header(block)
    except BadHeader:
        return int(any(block))
    if not header.flags & FLAG_SLOT or not header.generation:
        return 1
    if HEADER_SIZE + header.meta.size > slab.slot_size:
        return 1
    ref = SlotRef(slab.number, slot, slab.offset(slot), slab.slot_size, header.generation)
    return SlotFound(header.meta, ref, header.written_ns)


def resolve(
    files: list[tuple[ChunkMeta, int]],
    slots: list[SlotFound],
    known: Container[ChunkKey],
    known_slots: Container[ChunkKey],
) -> Resolved:
    """Keep the newest copy of each chunk. ``known``: chunks written since the tier opened
    (their copy wins); ``known_slots``: those of them held in a slot (a file found for one is
    stale; a file found for another known chunk is the very file written, kept)."""
    best: dict[ChunkKey, tuple[tuple[int, int, int], ChunkMeta | SlotFound]] = {}
    stale_slots: list[SlotRef] = []
    stale_files: list[ChunkKey] = []

    def offer(key: ChunkKey, rank: tuple[int, int, int], item: ChunkMeta | SlotFound) -> None:
        held = best.get(key)
        loser: ChunkMeta | SlotFound | None = item
        if held is None or rank > held[0]:
            best[key] = (rank, item)
            loser = held[1] if held else None
        if isinstance(loser, SlotFound):
            stale_slots.append(loser.ref)
        elif loser is not None:
            stale_files.append(key)

    for meta, written in files:
        if meta.key in known_slots:
            stale_files.append(meta.key)
        elif meta.key not in known:
            offer(meta.key, (written, 0, 0), meta)
    newest: dict[ChunkKey, SlotFound] = {}
    for found in slots:
        held_slot = newest.get(found.meta.key)
        if found.meta.key in known:
            stale_slots.append(found.ref)
        elif held_slot is None or found.ref.generation > held_slot.ref.generation:
            newest[found.meta.key] = found
            if held_slot is not None:
                stale_slots.append(held_slot.ref)
        else:
            stale_slots.append(found.ref)
    for found in newest.values():
        offer(found.meta.key, (found.written_ns, 1, found.ref.generation), found)
    kept = [item for _, item in best.values()]
    return Resolved(
        [m for m in kept if isinstance(m, ChunkMeta)],
        [s for s in kept if isinstance(s, SlotFound)],
        stale_slots,
        stale_files,
    )
