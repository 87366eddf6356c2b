"""The lossless codecs (bf16x, fp16x, int4e) and their container: bit-exact round trips, the
sizes they promise, and hostile containers that must fail with CodecError (never another
exception, never wrong bytes)."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest
import torch
import xxhash

from kvstrata.clients.layout import pack_chunk, unpack_into
from kvstrata.codecs import CodecError, container, decode, encode, entropy, read_header

pytestmark = pytest.mark.skipif(not entropy.have_rans(), reason="C extension not built")


def kv(layers=2, heads=4, tokens=64, dim=32, dtype=torch.bfloat16, seed=0):
    """Synthetic KV: per-channel outlier scales, values correlated along tokens."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(1.5 * torch.randn(1, heads, 1, dim, generator=g))
    base = torch.randn(layers, heads, 1, dim, generator=g)
    x = (base + 0.3 * torch.randn(layers, heads, tokens, dim, generator=g)) * scale
    return x.to(dtype)


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("coder", ["rans", "zstd"])
@pytest.mark.parametrize("codec,dtype", [("bf16x", torch.bfloat16), ("fp16x", torch.float16)])
def test_opaque_round_trip_is_bit_exact(codec, dtype, coder):
    if coder == "zstd" and not entropy.have_zstd():
        pytest.skip("zstandard not installed")
    data = raw_bytes(kv(layers=4, tokens=256, dtype=dtype)) + b"\x7f"  # odd length on purpose
    blob = encode(data, codec, coder=coder)
    assert blob is not None and len(blob) < len(data)
    assert bytes(decode(blob)) == data
    assert read_header(blob).codec == codec


def test_bf16x_keeps_every_bit_pattern():
    """NaNs with payloads, infinities, -0, subnormals: all 65536 patterns, many times over."""
    patterns = np.arange(65536, dtype="<u2")
    rng = np.random.default_rng(1)
    skewed = (rng.normal(0, 1, 200_000).astype(np.float32).view("<u4") >> 16).astype("<u2")
    data = np.concatenate([patterns, skewed]).tobytes()
    blob = encode(data, "bf16x", coder="rans", min_gain=-1.0)
    assert blob is not None
    assert bytes(decode(blob)) == data


def test_kvst_payload_is_coded_per_layer_and_layers_decode_alone():
    k, v = kv(layers=3), kv(layers=3, seed=1)
    payload = bytes(pack_chunk(list(k), list(v), "raw"))
    blob = encode(payload, "bf16x")
    assert blob is not None
    head = read_header(blob)
    for which, t in ((0, k), (1, v)):
        for layer in range(3):
            (i,) = head.layer_segments(layer, which)
            seg = head.segments[i]
            out = bytearray(seg.out_len)
            container.decode_segment(blob, seg, memoryview(out))
            assert bytes(out) == raw_bytes(t[layer])
    assert bytes(decode(blob)) == payload


def test_int4e_is_lossless_smaller_and_reconstructs_like_int4():
    k, v = kv(layers=2, tokens=256, dim=64), kv(layers=2, tokens=256, dim=64, seed=3)
    payload = bytes(pack_chunk(list(k), list(v), "int4"))
    blob = encode(payload, "int4e")
    assert blob is not None
    assert len(blob) <= 0.9 * len(payload), len(blob) / len(payload)
    kinds = {s.transform for s in read_header(blob).segments}  # codes, fp16 and fp32 stats
    assert {container.T_NIB4, container.T_PLANES2, container.T_PLANES4} <= kinds
    back = decode(blob)
    assert bytes(back) == payload
    outs = [[torch.empty(4, 256, 64) for _ in range(2)] for _ in range(4)]
    unpack_into(payload, outs[0], outs[1])
    unpack_into(back, outs[2], outs[3])
    for a, b in zip(outs[0] + outs[1], outs[2] + outs[3], strict=True):
        assert torch.equal(a, b)


def test_int4e_refuses_what_is_not_int4():
    payload = bytes(pack_chunk(list(kv()), list(kv()), "raw"))
    with pytest.raises(CodecError, match="int4"):
        encode(payload, "int4e")
    with pytest.raises(CodecError, match="unknown codec"):
        encode(payload, "zip")


def test_incompressible_payload_stays_raw():
    data = random.Random(2).randbytes(1 << 16)
    assert encode(data, "bf16x") is None
    assert encode(data, "bf16x", coder="rans") is None


def test_rans_size_meets_the_entropy_of_its_table():
    """Independent check of the coder: coded bits within 0.5 % (plus state flushes) of the
    cross-entropy of the stream under the table it wrote."""
    rng = np.random.default_rng(4)
    sym = np.clip(rng.normal(120, 3, 300_001), 0, 255).astype(np.uint8).tobytes()
    used, table, coded = entropy.encode(sym, entropy.CODER_RANS)
    assert used == entropy.CODER_RANS
    freq = np.frombuffer(entropy.unpack_table(table), dtype="<u2").astype(np.float64)
    counts = entropy.histogram(sym)
    bits = float(-(counts[counts > 0] * np.log2(freq[counts > 0] / 4096)).sum())
    assert len(coded) * 8 <= bits * 1.005 + 8 * 32 + 16  # eight 32-bit states flushed
    assert len(coded) * 8 >= bits - 64  # no coder beats the cross-entropy
    out = bytearray(len(sym))
    entropy.decode(used, table, coded, memoryview(out))
    assert bytes(out) == sym


def test_rans_matches_constriction_reference():
    """Same quantised model in constriction's range ANS coder: sizes agree within 1 %."""
    constriction = pytest.importorskip("constriction")
    rng = np.random.default_rng(5)
    sym = np.clip(rng.normal(8, 2.5, 100_000), 0, 15).astype(np.uint8)
    _, table, coded = entropy.encode(sym.tobytes(), entropy.CODER_RANS)
    freq = np.frombuffer(entropy.unpack_table(table), dtype="<u2")[:16].astype(np.float64)
    model = constriction.stream.model.Categorical(freq / freq.sum(), perfect=False)
    coder = constriction.stream.stack.AnsCoder()
    coder.encode_reverse(sym.astype(np.int32), model)
    theirs = coder.get_compressed().nbytes
    assert abs(len(coded) - theirs) <= 0.01 * theirs + 16


def test_without_the_c_coder(monkeypatch):
    data = raw_bytes(kv(tokens=128))
    blob = encode(data, "bf16x", coder="rans")
    assert blob is not None
    a, b = entropy.split16(data, 0)
    monkeypatch.setattr(entropy, "_rans", None)
    assert entropy.split16(data, 0) == (a, b)  # the numpy fallback splits the same way
    out = bytearray(len(data))
    entropy.merge16(a, b, memoryview(out), 0)
    assert bytes(out) == data
    assert encode(data, "bf16x", coder="rans") is None  # stored streams: no gain
    with pytest.raises(CodecError, match="C extension"):
        decode(blob)


# -- hostile containers ----------------------------------------------------------------------


def _blob() -> bytes:
    """An int4e container: stored, 4-bit and byte-plane segments, all under the fuzz."""
    payload = bytes(
        pack_chunk(list(kv(layers=2, tokens=32)), list(kv(layers=2, tokens=32)), "int4")
    )
    blob = encode(payload, "int4e", min_gain=-1.0)
    assert blob is not None
    return blob


def _reseal(blob: bytearray) -> bytes:
    """Recompute the header checksum, so that the field checks themselves are exercised."""
    hlen = min(struct.unpack_from("<I", blob, 12)[0], len(blob))
    if hlen >= 8 + 24:
        struct.pack_into("<Q", blob, hlen - 8, xxhash.xxh3_64_intdigest(bytes(blob[: hlen - 8])))
    return bytes(blob)


def _decodes_only_to_the_original(blob: bytes, original: bytes) -> None:
    try:
        got = decode(blob, max_size=1 << 24)
    except CodecError:
        return
    assert bytes(got) == original


def test_truncated_and_extended_containers_fail_clearly():
    blob = _blob()
    for cut in sorted({0, 3, 4, 10, 31, 32, 60, 100, len(blob) // 2, len(blob) - 1}):
        with pytest.raises(CodecError):
            decode(blob[:cut])
    with pytest.raises(CodecError, match="stray"):
        decode(blob + b"\0")


def test_bad_magic_version_and_header_checksum():
    blob = bytearray(_blob())
    with pytest.raises(CodecError, match="magic"):
        decode(b"XXXX" + bytes(blob[4:]))
    struct.pack_into("<H", blob, 4, 9)
    with pytest.raises(CodecError, match="version 9"):
        decode(bytes(blob))
    struct.pack_into("<H", blob, 4, 1)
    blob[40] ^= 1
    with pytest.raises(CodecError, match="header checksum"):
        decode(bytes(blob))


def test_fuzzed_headers_never_crash_or_mislead():
    original = bytes(decode(_blob()))
    base = _blob()
    (count, hlen) = struct.unpack_from("<II", base, 8)
    rng = random.Random(6)
    for _ in range(600):
        blob = bytearray(base)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(hlen - 8)
            blob[at] = rng.randrange(256)
        _decodes_only_to_the_original(_reseal(blob), original)
    for _ in range(200):  # offsets and lengths set to edge values
        blob = bytearray(base)
        seg = 24 + rng.randrange(count) * 48
        field = rng.choice([8, 16, 24, 32, 36, 40])
        fmt = "<I" if field in (32, 36) else "<Q"
        value = rng.choice([0, 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1])
        struct.pack_into(fmt, blob, seg + field, value % (2 ** (8 * struct.calcsize(fmt))))
        _decodes_only_to_the_original(_reseal(blob), original)


def test_corrupt_data_is_caught_by_the_segment_checksums():
    base = _blob()
    hlen = struct.unpack_from("<I", base, 12)[0]
    rng = random.Random(7)
    failures = 0
    for _ in range(300):
        blob = bytearray(base)
        blob[rng.randrange(hlen, len(blob))] ^= 1 << rng.randrange(8)
        try:
            decode(bytes(blob))
        except CodecError:
            failures += 1
            continue
        raise AssertionError("a flipped bit decoded without an error")
    assert failures == 300


def test_unpack_into_takes_a_coded_payload():
    """Client side, per namespace: a payload coded by the client before KV.PUT (here int4e)
    unpacks like the payload it codes; a damaged one is a LayoutError."""
    from kvstrata.clients.layout import LayoutError

    k, v = kv(tokens=128, dim=64), kv(tokens=128, dim=64, seed=8)
    payload = bytes(pack_chunk(list(k), list(v), "int4"))
    blob = encode(payload, "int4e")
    assert blob is not None
    want = [[torch.empty(4, 128, 64) for _ in range(2)] for _ in range(2)]
    got = [[torch.empty(4, 128, 64) for _ in range(2)] for _ in range(2)]
    unpack_into(payload, *want)
    unpack_into(blob, *got)
    for a, b in zip(want[0] + want[1], got[0] + got[1], strict=True):
        assert torch.equal(a, b)
    with pytest.raises(LayoutError, match="coded payload"):
        unpack_into(blob[:-1], *got)
