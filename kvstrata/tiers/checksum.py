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
