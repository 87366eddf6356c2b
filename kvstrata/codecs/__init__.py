"""Lossless coding of chunk payloads for slow links (the S3 tier): ``bf16x``, ``fp16x``,
``int4e`` in a checked binary container (:mod:`kvstrata.codecs.container`).

A leaf package: numpy, xxhash, the optional ``zstandard`` and the C coder of
:mod:`kvstrata.codecs._rans`; no torch, nothing of the server, the store or the tiers, so any
tier and any client can use it.
"""

from kvstrata.codecs.container import CODECS, decode, decode_into, encode, is_container, read_header
from kvstrata.codecs.errors import CodecError

__all__ = ["CODECS", "CodecError", "decode", "decode_into", "encode", "is_container", "read_header"]
