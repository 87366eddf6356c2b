"""Chunk checksums: xxh3-128, verified whenever bytes leave a persistent tier.

``bench/bench_checksum.py`` measures xxh3-128 against BLAKE3 next to memcpy on the same machine;
xxh3-128 runs at several times disk bandwidth (see ``docs/tiers.md``), so checking every NVMe
read costs little. BLAKE3 is a cryptographic hash we do not need (chunk hashes already name the
content; the checksum only catches torn writes and bit rot) and stays a bench-only dependency.
"""

from __future__ import annotations

import xxhash

Buffer = bytes | bytearray | memoryview

#: Name of the algorithm, shown by INFO and written nowhere else (the NVMe format version
#: implies it).
CHECKSUM_NAME = "xxh3-128"
CHECKSUM_BYTES = 16


def checksum(data: Buffer) -> bytes:
    """The 16-byte xxh3-128 digest of ``data`` (any contiguous buffer, not copied)."""
    return xxhash.xxh3_128_digest(data)


def verify(data: Buffer, expected: bytes) -> bool:
    """True when ``data`` has the checksum ``expected``."""
    return checksum(data) == expected


class RunningChecksum:
    """The checksum of a buffer filled front to back, folded in as its bytes arrive.

    A large ``KV.PUT`` payload lands in its DRAM slot over many socket reads; hashing each
    read's bytes right away (while they are still in the CPU cache, and while the connection
    waits for the next ones anyway) leaves nothing to hash once the last byte is in, instead
    of one cold pass over the whole payload before the reply. :meth:`digest` folds in whatever
    was not reported, so the result is always the checksum of the whole buffer.
    """

    __slots__ = ("_state", "done")

    def __init__(self) -> None:
        self._state = xxhash.xxh3_128()
        self.done = 0  # bytes folded in so far (a prefix of the buffer)

    def advance(self, data: memoryview, filled: int) -> None:
        """Bytes ``[0, filled)`` of ``data`` are final: fold in the ones not seen yet."""
        if filled > self.done:
            self._state.update(data[self.done : filled])
            self.done = filled

    def digest(self, data: memoryview) -> bytes:
        """The checksum of all of ``data`` (the same as ``checksum(data)``)."""
        self.advance(data, data.nbytes)
        return self._state.digest()
