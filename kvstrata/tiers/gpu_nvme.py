"""NVMe → GPU without a host copy of the payload: kvikio CuFile reads a chunk file into a slot.

:func:`load_from_nvme` reads the chunk file of an :class:`~kvstrata.tiers.nvme.NvmeTier`
(format in ``_nvme_format``: a 4096-byte header, the payload at 4096) straight into a new
slot of the :class:`~kvstrata.tiers.gpu.GpuTier`:

- with kvikio importable, ``CuFile.pread`` lands the payload in device memory: GPUDirect
  Storage where the driver and filesystem allow it, kvikio's compatibility mode (POSIX reads
  through its own pinned bounce buffers) otherwise; :func:`kvikio_mode` says which;
- without kvikio (or over the host stand-in of the CPU tests) the file is read with ``preadv``
  into a host buffer and copied to the slot.

Integrity: the header is checked (magic, header checksum, the key it names, the size) before
the payload is read, and the payload's xxh3-128 is verified before the slot is published. On
the device path that costs one device → host copy into a scratch buffer (PCIe 5 runs it several
times faster than an NVMe read, see ``docs/gpu.md``); a mismatch quarantines nothing here but
raises :class:`IntegrityError`, and the slot is freed, so wrong bytes never become visible.

The file is opened once per read: a concurrent replacement (rename over it) leaves the open
file intact, so header and payload always come from the same version.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import numpy as np

from kvstrata.store.keys import ChunkMeta
from kvstrata.tiers._nvme_format import HEADER_SIZE, BadHeader, chunk_relpath, decode_header
from kvstrata.tiers.base import ChunkMissing, IntegrityError
from kvstrata.tiers.checksum import checksum
from kvstrata.tiers.gpu import GpuTier
from kvstrata.tiers.gpu_memory import DeviceMemory


def kvikio_importable() -> bool:
    return importlib.util.find_spec("kvikio") is not None


def kvikio_mode() -> str:
    """ "gds", "compat" (kvikio without GPUDirect Storage) or "absent"."""
    if not kvikio_importable():
        return "absent"
    import kvikio.defaults as defaults

    for probe in ("is_compat_mode_preferred", "compat_mode"):  # names differ across versions
        fn = getattr(defaults, probe, None)
        if callable(fn):
            return "compat" if bool(fn()) else "gds"
    return "unknown"


def chunk_path(root: str, meta: ChunkMeta) -> str:
    """The chunk file of ``meta`` under an NVMe tier folder."""
    return os.path.join(root, chunk_relpath(meta.key))


def _check_header(block: bytes, want: ChunkMeta, path: str) -> None:
    try:
        got = decode_header(block).meta
    except BadHeader as exc:
        raise IntegrityError(f"{path}: {exc}") from None
    if got.key != want.key or got.size != want.size or got.checksum != want.checksum:
        raise IntegrityError(f"{path}: header does not describe chunk {want.key.hex}")


def _verify(mem: DeviceMemory, offset: int, want: ChunkMeta, path: str) -> None:
    scratch = np.empty(want.size, dtype=np.uint8)
    mem.to_host(offset, scratch.data)
    if checksum(scratch.data) != want.checksum:
        raise IntegrityError(f"{path}: payload checksum mismatch after the read into the gpu")


def read_file_kvikio(path: str, want: ChunkMeta, mem: DeviceMemory, offset: int) -> None:
    """Blocking: header to host, payload straight into ``mem`` at ``offset``, then verify."""
    import kvikio

    if not os.path.exists(path):  # kvikio reports a missing file as a generic RuntimeError
        raise FileNotFoundError(path)
    head = np.empty(HEADER_SIZE, dtype=np.uint8)
    with kvikio.CuFile(path, "r") as f:
        if int(f.pread(head, HEADER_SIZE, 0).get()) < HEADER_SIZE:
            raise IntegrityError(f"{path}: truncated header")
        _check_header(head.tobytes(), want, path)
        if want.size:
            got = int(f.pread(mem.buffer(offset, want.size), want.size, HEADER_SIZE).get())
            if got < want.size:
                raise IntegrityError(f"{path}: truncated payload ({got} of {want.size} bytes)")
    _verify(mem, offset, want, path)


def read_file_posix(path: str, want: ChunkMeta, mem: DeviceMemory, offset: int) -> None:
    """Blocking: the file into a host buffer, verified, then copied into ``mem``."""
    buf = bytearray(HEADER_SIZE + want.size)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        got = os.preadv(fd, [buf], 0)
    finally:
        os.close(fd)
    _check_header(bytes(buf[:HEADER_SIZE]), want, path)
    if got < len(buf):
        raise IntegrityError(f"{path}: truncated payload ({got - HEADER_SIZE} of {want.size})")
    payload = memoryview(buf)[HEADER_SIZE:]
    if checksum(payload) != want.checksum:
        raise IntegrityError(f"{path}: payload checksum mismatch")
    mem.to_device(offset, payload)


async def load_from_nvme(
    gpu: GpuTier, nvme_root: str, meta: ChunkMeta, use_kvikio: bool | None = None
) -> str:
    """Read ``meta``'s chunk file under ``nvme_root`` into a new GPU slot and publish it there.

    Returns the path taken ("kvikio-gds", "kvikio-compat" or "posix"). Raises
    :class:`ChunkMissing` when the file is gone, :class:`IntegrityError` when it is not the
    expected chunk or its bytes are wrong, TierFull when the pool has no room.
    """
    path = chunk_path(nvme_root, meta)
    if use_kvikio is None:
        use_kvikio = kvikio_importable() and not gpu.memory.host_addressable
    reader: Any = read_file_kvikio if use_kvikio else read_file_posix
    try:
        await gpu.put_from(meta, lambda mem, offset: reader(path, meta, mem, offset))
    except FileNotFoundError:
        raise ChunkMissing(meta.key) from None
    return f"kvikio-{kvikio_mode()}" if use_kvikio else "posix"
