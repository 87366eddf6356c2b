"""Slab files of the NVMe tier: small chunks packed into fixed-size slots, no file per chunk.

A chunk of at most ``nvme-slab-max`` bytes (1 MiB by default; 0 turns slabs off) goes into a
slot of a slab file instead of a file of its own; larger chunks keep the file layout
(``_nvme_files``). A write is then one aligned ``pwritev`` into space the file already has —
no create, rename, allocation or directory update per chunk.

Layout: ``slabs/{n:06d}.slab``. Bytes 0-4095 are the slab header (:data:`SLAB_MAGIC`, version,
slot size, most slots, creation time, xxh3-128 of the rest); slot ``i`` starts at
``4096 + i * slot_size``. A slot is a chunk header (``_nvme_format``, flag ``FLAG_SLOT`` and a
generation) followed by the payload, the last block zero-padded; its slot size is 4096 plus a
size class (:data:`CLASSES`, the smallest that holds the payload). One slab file holds one slot
size and grows in steps of about :data:`GROW_BYTES` (``fallocate``) up to ``slab_bytes``.

Guarantees, as with chunk files: header and payload checksums (a slot that fails either is
never served: it becomes free); every new write gets a generation above every other, those
found on disk at start included (two valid slots naming one chunk after a crash: the higher
wins, the other is invalidated; the wall clock, which may step back, does not decide); a
delete or the replaced copy of an overwrite is invalidated on disk (its header block zeroed)
before its slot is reused, so a restart cannot bring it back. Free slots live in memory only,
rebuilt at start by reading every slot header (``_nvme_slab_scan``).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from dataclasses import dataclass

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.tiers._nvme_format import (
    HEADER_SIZE,
    BadHeader,
    WriteClock,
    decode_header,
    encode_header,
)
from kvstrata.tiers._nvme_io import _O_DIRECT, Backend, _staging
from kvstrata.tiers.base import IntegrityError
from kvstrata.tiers.checksum import checksum

KiB = 1024
#: payload size classes (bytes); a slot is 4096 + its class
CLASSES = tuple(k * KiB for k in (4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512,
                                  768, 1024, 1536, 2048, 3072, 4096))  # fmt: skip
SLAB_MAGIC = b"KVSLAB01"
SLAB_VERSION = 1
SLAB_DIR = "slabs"
SLAB_SUFFIX = ".slab"
GROW_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class SlotRef:
    """Where a chunk lives in a slab: file number, slot, and the generation written there."""

    slab: int
    slot: int
    offset: int
    slot_size: int
    generation: int


class SlotMismatch(Exception):
    """A slot read did not find the chunk expected there (torn, corrupt, or reused)."""


@dataclass(slots=True)
class Slab:
    """One open slab file; ``grown``: slots inside the file's size; ``fresh``: slots never
    handed out since start (between ``fresh`` and ``grown`` the file has room already)."""

    number: int
    path: str
    fd: int
    slot_size: int
    max_slots: int
    grown: int
    fresh: int = 0

    def offset(self, slot: int) -> int:
        return HEADER_SIZE + slot * self.slot_size


def slot_size_for(size: int, limit: int) -> int:
    """The slot size for a ``size``-byte payload, 0 when it goes to a chunk file."""
    if size > limit:
        return 0
    for cls in CLASSES:
        if size <= cls:
            return HEADER_SIZE + cls
    return 0


def encode_slab_header(slot_size: int, max_slots: int) -> bytes:
    block = bytearray(HEADER_SIZE)
    fields = (SLAB_VERSION, HEADER_SIZE, slot_size, max_slots, time.time_ns())
    block[:8] = SLAB_MAGIC
    block[8:48] = b"".join(v.to_bytes(8, "little") for v in fields)
    block[-16:] = checksum(memoryview(block)[:-16])
    return bytes(block)


def decode_slab_header(block: bytes) -> tuple[int, int]:
    """(slot size, most slots) of a slab header; ValueError when it is not one."""
    if len(block) < HEADER_SIZE or block[:8] != SLAB_MAGIC:
        raise ValueError("not a kvstrata slab file (bad magic)")
    if checksum(memoryview(block)[: HEADER_SIZE - 16]) != block[HEADER_SIZE - 16 : HEADER_SIZE]:
        raise ValueError("slab header checksum mismatch")
    version, hlen, slot_size, max_slots = (
        int.from_bytes(block[8 + 8 * i : 16 + 8 * i], "little") for i in range(4)
    )
    if version != SLAB_VERSION or hlen != HEADER_SIZE or slot_size % 4096 or slot_size < 8192:
        raise ValueError(f"unsupported slab version {version} / slot size {slot_size}")
    return slot_size, max_slots


class Slabs:
    """The slab files under ``root/slabs``: allocation, slot writes, reads, invalidation.

    Every method but :meth:`slot_size` blocks (file I/O) and runs on the tier's pool; the
    allocator's lock is held only in those threads, never across an ``await``."""

    def __init__(
        self,
        root: str,
        backend: Backend,
        limit: int,
        slab_bytes: int,
        fsync: str,
        clock: WriteClock | None = None,
    ) -> None:
        self.folder = os.path.join(root, SLAB_DIR)
        self.clock = clock or WriteClock()
        self.fsync = fsync
        self.backend = backend
        self.limit = limit
        self.slab_bytes = slab_bytes
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        #: slab files found at start, read by :func:`_nvme_slab_scan.scan_slabs` (not yet open)
        self.unscanned = sorted(_numbers(self.folder))
        self._numbers = itertools.count(max(self.unscanned, default=0) + 1)
        self.slabs: dict[int, Slab] = {}
        self._growing: dict[int, Slab] = {}  # slot size → the slab new slots come from
        self._free: dict[int, list[tuple[int, int]]] = {}  # slot size → (slab, slot) free
        self._lock = threading.Lock()
        self._generation = time.time_ns()

    def slot_size(self, size: int) -> int:
        return slot_size_for(size, self.limit)

    def spare_bytes(self) -> int:
        """Disk space the slab files hold for new slots without growing (free + fresh)."""
        with self._lock:
            fresh = sum((s.grown - s.fresh) * s.slot_size for s in self.slabs.values())
            return fresh + sum(size * len(free) for size, free in self._free.items())

    # -- allocation ---------------------------------------------------------------------

    def _allocate(self, slot_size: int) -> SlotRef:
        with self._lock:
            return self._take(slot_size)

    def take_ready(self, slot_size: int) -> SlotRef | None:
        """A slot the files have room for already (free or fresh), None when taking one would
        grow a slab file or make a new one (blocking work: the caller uses the pool then)."""
        with self._lock:
            slab = self._growing.get(slot_size)
            ready = slab is not None and slab.fresh < min(slab.grown, slab.max_slots)
            if not self._free.get(slot_size) and not ready:
                return None
            return self._take(slot_size)

    def allocate_many(self, slot_size: int, n: int) -> tuple[list[SlotRef], OSError | None]:
        """Up to ``n`` slots under one hold of the lock (fresh ones are then adjacent), and
        the error that stopped it short (a slab file that could not grow), if any."""
        refs: list[SlotRef] = []
        with self._lock:
            try:
                while len(refs) < n:
                    refs.append(self._take(slot_size))
            except OSError as exc:
                return refs, exc
        return refs, None

    def _take(self, slot_size: int) -> SlotRef:
        """The next slot of ``slot_size`` (a free one first); the lock is held."""
        free = self._free.get(slot_size)
        if free:
            number, slot = free.pop()
        else:
            slab = self._growing.get(slot_size)
            if slab is None or slab.fresh == slab.max_slots:
                slab = self._new_slab(slot_size)
            if slab.fresh == slab.grown:
                self._grow(slab)
            number, slot = slab.number, slab.fresh
            slab.fresh += 1
        self._generation += 1
        slab = self.slabs[number]
        return SlotRef(number, slot, slab.offset(slot), slot_size, self._generation)

    def _new_slab(self, slot_size: int) -> Slab:
        max_slots = max(1, (self.slab_bytes - HEADER_SIZE) // slot_size)
        number = next(self._numbers)
        path = os.path.join(self.folder, f"{number:06d}{SLAB_SUFFIX}")
        fd = self.open(path, create=True)
        try:
            self._write_block(fd, encode_slab_header(slot_size, max_slots), 0)
            if self.fsync == "always":  # the new name, durable before any slot in it is acked
                os.fsync(fd)
                _fsync_folder(self.folder)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        slab = Slab(number, path, fd, slot_size, max_slots, grown=0)
        self.slabs[number] = self._growing[slot_size] = slab
        return slab

    def _grow(self, slab: Slab) -> None:
        """Extend the file by a step of slots, or by one when the disk has no room for more."""
        step = min(slab.max_slots - slab.grown, max(1, GROW_BYTES // slab.slot_size))
        end = slab.offset(slab.grown)
        for n in dict.fromkeys((step, 1)):
            try:
                os.posix_fallocate(slab.fd, end, n * slab.slot_size)
            except OSError:
                os.ftruncate(slab.fd, end)  # a failed fallocate may leave some blocks behind
                if n == 1:
                    raise
                continue
            slab.grown += n
            return

    def adopt(self, slab: Slab, free: list[int], generation: int = 0) -> None:
        """Take a slab file read at start, with its free slots and the highest generation
        found in it (new writes get higher ones, whatever the wall clock says); one with room
        to grow serves new slots of its size unless a slab made since start already does."""
        with self._lock:
            self.slabs[slab.number] = slab
            if slab.grown < slab.max_slots:
                self._growing.setdefault(slab.slot_size, slab)
            self._free.setdefault(slab.slot_size, []).extend((slab.number, i) for i in free)
            self._generation = max(self._generation, generation)

    def release(self, ref: SlotRef) -> None:
        """Make an invalidated (or never published) slot free again."""
        with self._lock:
            if ref.slab in self.slabs:
                self._free.setdefault(ref.slot_size, []).append((ref.slab, ref.slot))

    # -- I/O ------------------------------------------------------------------------------

    def open(self, path: str, create: bool = False) -> int:
        flags = os.O_RDWR | os.O_CLOEXEC | (_O_DIRECT if self.backend.direct else 0)
        return os.open(path, flags | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)

    def write(self, meta: ChunkMeta, payload: memoryview, sync: bool) -> tuple[ChunkMeta, SlotRef]:
        """Allocate a slot and write the chunk there (``sync``: and fdatasync the slab, for
        ``nvme-fsync always``); on failure the slot is invalidated and free again."""
        stored = self.stored(meta, payload)
        ref = self._allocate(self.slot_size(meta.size))
        slab = self.slabs[ref.slab]
        header = self.header(stored, ref)
        try:
            self.backend.write_at(slab.fd, slab.path, ref.offset, header, payload)
            if sync:
                os.fdatasync(slab.fd)
        except BaseException:
            self.discard(ref)
            raise
        return stored, ref

    def stored(self, meta: ChunkMeta, payload: memoryview) -> ChunkMeta:
        """``meta`` with the payload's checksum; IntegrityError if it names another one."""
        csum = checksum(payload)
        if meta.checksum and meta.checksum != csum:
            raise IntegrityError(f"payload of {meta.key.hex} does not match its checksum")
        return ChunkMeta(meta.key, meta.parent, meta.tokens, meta.size, csum, meta.codec)

    def header(self, stored: ChunkMeta, ref: SlotRef) -> bytes:
        """The chunk header block of ``stored`` for the slot ``ref``."""
        return encode_header(stored, stored.checksum, self.clock.now(), ref.generation)

    def read(self, key: ChunkKey, ref: SlotRef, out: memoryview, want: ChunkMeta) -> ChunkMeta:
        """Read and verify the chunk at ``ref`` into ``out``; :class:`SlotMismatch` if the slot
        does not hold exactly that chunk (generation, key, size, checksums)."""
        slab = self.slabs[ref.slab]
        block, got = self.backend.read_at(slab.fd, slab.path, ref.offset, out[: want.size])
        return self.verify(key, ref, want, block, got, out)

    def verify(
        self, key: ChunkKey, ref: SlotRef, want: ChunkMeta, block: bytes, got: int, out: memoryview
    ) -> ChunkMeta:
        """The checks of :meth:`read` on a slot read (header block, payload bytes read into
        ``out``); :class:`SlotMismatch` when it is not exactly the chunk expected."""
        try:
            header = decode_header(block)
        except BadHeader as exc:
            raise SlotMismatch(str(exc)) from None
        meta = header.meta
        if header.generation != ref.generation or meta.key != key or meta.size != want.size:
            raise SlotMismatch("the slot holds another chunk or generation")
        if got < meta.size:
            raise SlotMismatch(f"short read ({got} of {meta.size} bytes)")
        if checksum(out[: meta.size]) != meta.checksum:
            raise SlotMismatch("payload checksum mismatch")
        return meta

    def invalidate(self, ref: SlotRef, sync: bool = False) -> None:
        """Zero the slot's header block on disk (``sync``: and fdatasync), then free the slot."""
        slab = self.slabs.get(ref.slab)
        if slab is None:
            return
        self._write_block(slab.fd, bytes(HEADER_SIZE), ref.offset)
        if sync:
            os.fdatasync(slab.fd)
        self.release(ref)

    def discard(self, ref: SlotRef) -> None:
        """Invalidate a slot whose write failed, or leave it out of use when even that fails
        (its header may be valid: freeing it would let a restart find a slot reused)."""
        try:
            self.invalidate(ref)
        except OSError:
            pass

    def _write_block(self, fd: int, block: bytes, offset: int) -> None:
        stage = _staging()[:HEADER_SIZE]
        stage[:] = block
        if os.pwrite(fd, stage, offset) != HEADER_SIZE:
            raise OSError(5, "short write of a slab header block")

    def dup(self, ref: SlotRef) -> int:
        """A descriptor of the slot's slab for the group sync (which closes it)."""
        return os.dup(self.slabs[ref.slab].fd)

    def locate(self, ref: SlotRef) -> tuple[str, int]:
        return self.slabs[ref.slab].path, ref.offset

    def count(self) -> int:
        return len(self.slabs)

    def close(self) -> None:
        with self._lock:
            for slab in self.slabs.values():
                os.close(slab.fd)
            self.slabs.clear()
            self._growing.clear()
            self._free.clear()


def _fsync_folder(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _numbers(folder: str) -> list[int]:
    """Numbers of the slab files in ``folder`` (names ``{n:06d}.slab``)."""
    found = []
    for name in os.listdir(folder):
        stem = name[: -len(SLAB_SUFFIX)]
        if name.endswith(SLAB_SUFFIX) and stem.isdigit() and len(stem) == 6:
            found.append(int(stem))
    return found
