"""The one error of :mod:`kvstrata.codecs`."""

from __future__ import annotations


class CodecError(ValueError):
    """Coded bytes are malformed, truncated, of an unknown version or codec, or fail their
    checksum; or a payload cannot be coded the way asked. Never a partial result."""
