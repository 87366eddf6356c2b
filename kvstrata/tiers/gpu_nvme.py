"""NVMe → GPU without a host copy of the payload: kvikio CuFile reads a chunk file into a slot.

:func:`load_from_nvme` reads the chunk file of an :class:`~kvstrata.tiers.nvme.NvmeTier`
(format in ``_nvme_format``: a 4096-byte header, the payload at 4096) straight into a new
slot of the :class:`~kvstrata.tiers.gpu.GpuTier`:

- with kvikio importable, ``CuFile.pread`` lands the payload in device memory: GPUDirect
  Storage where the driver and filesystem allow it, kvikio's compatibility mode (POSIX reads
  through its own pinned bounce buffers) otherwise; :func:`kvikio_mode` says which;
- without kvikio (or over the host stand-in of the CPU tests) the file is read with ``preadv``
  into a host buffer and copied to the slot; so it is when kvikio's import fails (a broken
  install raises ImportError or OSError) or kvikio fails on a file that is intact
  (:class:`KvikioUnusable`).

kvikio raises one ``RuntimeError`` for a short read, a vanished file and a cuFile failure, so
the file's size is checked before the read and an error is explained after it: a file that is
gone is :class:`ChunkMissing`, one too short is :class:`IntegrityError` (the store then drops
it from the NVMe tier), anything else falls back to the POSIX read.

Integrity: the header is checked (magic, header checksum, the key it names, the size) before
the payload is read, and the payload's xxh3-128 is verified before the slot is published. On
the device path that costs one device → host copy into a scratch buffer (PCIe 5 runs it several
times faster than an NVMe read, see ``docs/gpu.md``); a mismatch quarantines nothing here but
raises :class:`IntegrityError`, and the slot is freed, so wrong bytes never become visible.

The file is opened once per read: a concurrent replacement (rename over it) leaves the open
file intact, so header and payload always come from the same version. A chunk held in a slot of
a slab file (``_nvme_slabs``: the same header, at an offset) is read from ``at``, which
:meth:`NvmeTier.locate` gives; a slot reused meanwhile fails the header or checksum check and
is an :class:`IntegrityError` like any wrong bytes.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from typing import Any

import numpy as np

from kvstrata.chunks import ChunkMeta
from kvstrata.tiers._nvme_format import HEADER_SIZE, BadHeader, chunk_relpath, decode_header
from kvstrata.tiers.base import ChunkMissing, IntegrityError, TierError
from kvstrata.tiers.checksum import checksum
from kvstrata.tiers.gpu import GpuTier
from kvstrata.tiers.gpu_memory import DeviceMemory

log = logging.getLogger(__name__)


class KvikioUnusable(Exception):
    """kvikio cannot read here (a broken install, a cuFile failure not explained by the file):
    the read falls back to the POSIX path."""


#: Why kvikio's import failed in this process ("" until it failed once): not retried per chunk.
_kvikio_broken = ""
_import = importlib.import_module  # a seam: the tests make the import fail like a broken install


def kvikio_importable() -> bool:
    """Whether a ``kvikio`` package is there (its import may still fail: :func:`import_kvikio`)."""
    if "kvikio" in sys.modules:
        return sys.modules["kvikio"] is not None
    try:
        return importlib.util.find_spec("kvikio") is not None
    except (ImportError, ValueError):
        return False


def import_kvikio() -> Any:
    """kvikio, or :class:`KvikioUnusable` saying why not: absent, or a broken install whose
    import raises ImportError/OSError/RuntimeError (libkvikio or libcufile not loadable)."""
    global _kvikio_broken
    if _kvikio_broken:
        raise KvikioUnusable(_kvikio_broken)
    try:
        return _import("kvikio")
    except (ImportError, OSError, RuntimeError) as exc:
        _kvikio_broken = f"kvikio cannot be imported: {type(exc).__name__}: {exc}"
        raise KvikioUnusable(_kvikio_broken) from exc


def compat_mode_of(defaults: Any) -> str:
    """What kvikio's compatibility setting means, across versions:

    - ≤ 24.10 ``defaults.compat_mode()`` is a bool;
    - 24.12–25.02 it is a ``CompatMode`` enum (``OFF``, ``ON``, ``AUTO``) and ``AUTO`` is
      truthy, so ``bool()`` of it says "compat" where cuFile may well be used;
    - ≥ 25.04 ``defaults.get("compat_mode")`` gives the enum, and
      ``is_compat_mode_preferred()`` only the global guess for ``AUTO``: a file on a filesystem
      without GDS support still falls back to compat mode.

    Returns "gds", "compat", "auto" (unresolved), "auto-gds" or "auto-compat" (the guess)."""
    value = _compat_setting(defaults)
    name = getattr(value, "name", None)
    if name is None:
        return "compat" if value else "gds"
    if name in ("ON", "OFF"):
        return "compat" if name == "ON" else "gds"
    preferred = getattr(defaults, "is_compat_mode_preferred", None)
    if callable(preferred):
        return "auto-compat" if preferred() else "auto-gds"
    return "auto"


def _compat_setting(defaults: Any) -> Any:
    get = getattr(defaults, "get", None)
    if callable(get):  # >= 25.04
        try:
            return get("compat_mode")
        except Exception:  # an older ``get`` of another meaning: ask the old way
            pass
    old = getattr(defaults, "compat_mode", None)
    return old() if callable(old) else None


def kvikio_mode() -> str:
    """ "gds", "compat", "auto…" (see :func:`compat_mode_of`), "absent" or "broken"."""
    if not kvikio_importable():
        return "absent"
    try:
        kvikio = import_kvikio()
        return compat_mode_of(_import("kvikio.defaults"))
    except KvikioUnusable:
        return "broken"
    except (ImportError, AttributeError) as exc:
        return f"unknown ({kvikio.__name__}: {exc})"


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


def read_file_kvikio(
    path: str, want: ChunkMeta, mem: DeviceMemory, offset: int, base: int = 0
) -> None:
    """Blocking: header to host, payload straight into ``mem`` at ``offset``, then verify.

    kvikio reports a short read, a vanished file and a cuFile failure alike as RuntimeError;
    the file's size is checked first, and an error is mapped afterwards: a missing file to
    FileNotFoundError, a short one to IntegrityError, anything else to KvikioUnusable (the
    caller then reads the file the POSIX way). ``base``: where the header starts in the file."""
    kvikio = import_kvikio()
    size = os.stat(path).st_size  # FileNotFoundError: the chunk is gone
    _check_size(path, size - base, want)
    head = np.empty(HEADER_SIZE, dtype=np.uint8)
    try:
        with kvikio.CuFile(path, "r") as f:
            if int(f.pread(head, HEADER_SIZE, base).get()) < HEADER_SIZE:
                raise IntegrityError(f"{path}: truncated header")
            _check_header(head.tobytes(), want, path)
            if want.size:
                dst = mem.buffer(offset, want.size)
                got = int(f.pread(dst, want.size, base + HEADER_SIZE).get())
                if got < want.size:
                    raise IntegrityError(f"{path}: truncated payload ({got} of {want.size} bytes)")
    except TierError:
        raise
    except (RuntimeError, OSError) as exc:
        raise _kvikio_failure(path, want, exc, base) from exc
    _verify(mem, offset, want, path)


def _check_size(path: str, size: int, want: ChunkMeta) -> None:
    if size < HEADER_SIZE + want.size:
        raise IntegrityError(
            f"{path}: truncated ({size} bytes, a {want.size}-byte chunk needs "
            f"{HEADER_SIZE + want.size})"
        )


def _kvikio_failure(path: str, want: ChunkMeta, exc: BaseException, base: int = 0) -> Exception:
    """The tier's error for a kvikio failure: explained by the file, or kvikio's own."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return FileNotFoundError(path)
    except OSError:
        size = -1
    if 0 <= size < base + HEADER_SIZE + want.size:
        return IntegrityError(f"{path}: truncated during the read ({size} bytes)")
    return KvikioUnusable(f"kvikio failed reading {path}: {type(exc).__name__}: {exc}")


def read_file_posix(
    path: str, want: ChunkMeta, mem: DeviceMemory, offset: int, base: int = 0
) -> None:
    """Blocking: the chunk (header at ``base``) into a host buffer, verified, then copied into
    ``mem``."""
    buf = bytearray(HEADER_SIZE + want.size)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        got = os.preadv(fd, [buf], base)
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
    gpu: GpuTier,
    nvme_root: str,
    meta: ChunkMeta,
    use_kvikio: bool | None = None,
    at: tuple[str, int] | None = None,
) -> str:
    """Read ``meta``'s chunk file under ``nvme_root`` (or the file and header offset ``at``: a
    slab slot) into a new GPU slot and publish it there.

    Returns the path taken ("kvikio-" and :func:`kvikio_mode`, or "posix"; "posix" also when
    kvikio was tried but could not read, see :class:`KvikioUnusable`). Raises
    :class:`ChunkMissing` when the file is gone, :class:`IntegrityError` when it is not the
    expected chunk, is short or its bytes are wrong, TierFull when the pool has no room.
    """
    path, base = at if at is not None else (chunk_path(nvme_root, meta), 0)
    if use_kvikio is None:
        use_kvikio = kvikio_importable() and not gpu.memory.host_addressable
    how = "posix"

    def fill(mem: DeviceMemory, offset: int) -> None:
        nonlocal how
        if use_kvikio:
            try:
                read_file_kvikio(path, meta, mem, offset, base)
                how = f"kvikio-{kvikio_mode()}"
                return
            except KvikioUnusable as exc:
                log.warning("gpu: %s; reading %s the POSIX way", exc, path)
        read_file_posix(path, meta, mem, offset, base)

    try:
        await gpu.put_from(meta, fill)
    except FileNotFoundError:
        raise ChunkMissing(meta.key) from None
    return how
