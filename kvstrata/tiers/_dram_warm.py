"""Warming the DRAM arena: faulting its pages in without changing a byte.

A fresh page of a shared-memory segment faults in on its first write (~1 GB/s on these
machines); a faulted-in page copies at memcpy speed (~10 GB/s). The server answers KV commands
while the arena warms in the background, so the warm-up runs beside chunks being written into
the same pages (by the event loop, the kernel's ``recv_into``, or an engine writing through a
write lease) and must therefore never write itself:

- ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+) asks the kernel to fault every page of a range
  in writable, as a write would, leaving the contents as they are (a page already holding a
  chunk is left alone);
- where the kernel refuses the advice (``EINVAL`` on older kernels), one byte per page is read:
  on tmpfs (``/dev/shm``) a read fault of a shared mapping allocates the page too (there is no
  shared zero page), with a writable mapping, and reading changes nothing.

Both run on a worker thread with the GIL released (ctypes releases it around the foreign call;
numpy's strided reduction releases it too). Any other failure (``EFAULT``/``ENOMEM``: the
segment cannot be backed, ``/dev/shm`` is too small) is raised as ``OSError``: the tier logs it
and stops warming; chunks already written are untouched.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from typing import Any

import numpy as np

PAGE = 4096
#: the advice's value in <linux/mman.h> (Python's mmap module names it from 3.13 on)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _libc_madvise() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class PageWarmer:
    """Faults ranges of ``buf`` (a page-aligned mapping) in; see the module docstring.

    ``method`` is ``"madvise"`` until the kernel refuses it, then ``"read"``."""

    def __init__(self, buf: memoryview, force_read: bool = False) -> None:
        self._buf = buf
        arr = np.frombuffer(buf, dtype=np.uint8)
        self._addr = int(arr.ctypes.data)  # the export ends with ``arr``; the mapping stays
        del arr
        self._madvise: Any = None if force_read else _libc_madvise()
        self.method = "madvise" if self._madvise is not None else "read"

    def warm(self, start: int, end: int) -> None:
        """Fault ``[start, end)`` in (``start`` a multiple of :data:`PAGE`), contents kept."""
        if end <= start:
            return
        if self.method == "madvise" and self._populate(start, end):
            return
        np.frombuffer(self._buf[start:end], dtype=np.uint8)[::PAGE].max()

    def _populate(self, start: int, end: int) -> bool:
        """True when the kernel populated the range; False when it does not know the advice
        (the warmer switches to reading); OSError for any other failure."""
        while True:
            rc = self._madvise(self._addr + start, end - start, MADV_POPULATE_WRITE)
            if rc == 0:
                return True
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err in (errno.EINVAL, errno.ENOSYS):
                self.method = "read"
                return False
            raise OSError(err, f"madvise(MADV_POPULATE_WRITE) failed: {os.strerror(err)}")
