"""Which codec a tier applies to a chunk it stores (``s3-codec``), and the call that never
refuses: a payload the codec does not fit, or that would not shrink by 3 %, stays raw."""

from __future__ import annotations

from kvstrata.codecs import container, kvst
from kvstrata.codecs.errors import CodecError

#: values of ``s3-codec``
TIER_CODECS = ("none", "bf16x", "fp16x", "int4e", "auto")
_AUTO = {(kvst.CODEC_RAW, kvst.DTYPE_BF16): "bf16x", (kvst.CODEC_RAW, kvst.DTYPE_FP16): "fp16x"}


def pick(payload: memoryview, choice: str) -> str | None:
    """The codec ``choice`` means for this payload, or None (store raw).

    ``auto`` reads a ``KVST`` payload's header: raw bf16 → ``bf16x``, raw fp16 → ``fp16x``,
    ``int4`` → ``int4e``, other codecs (fp8, int8) none; opaque bytes (an engine's own layout,
    bf16 in every engine kvstrata serves by default) → ``bf16x``, kept only if it gains."""
    if choice == "none":
        return None
    layout = kvst.read(payload)
    is_int4 = layout is not None and layout.codec == kvst.CODEC_INT4
    if choice == "int4e":
        return "int4e" if is_int4 else None
    if choice != "auto":
        return choice
    if layout is None:
        return "bf16x"
    return "int4e" if is_int4 else _AUTO.get((layout.codec, layout.dtype))


def encode_for_tier(
    payload: bytes | bytearray | memoryview, choice: str
) -> tuple[str, bytes] | None:
    """(codec, container) of a payload a tier stores with ``s3-codec`` = ``choice``; None:
    keep the payload raw."""
    view = memoryview(payload).cast("B")
    codec = pick(view, choice)
    if codec is None:
        return None
    try:
        blob = container.encode(view, codec)
    except CodecError:
        return None
    return None if blob is None else (codec, blob)
