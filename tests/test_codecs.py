"""KV codecs: lossless raw, fp8 e4m3 and KIVI-style int8/int4 (error bounds, axes, sizes)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import torch

from kvstrata.clients.codecs import CODECS, get_codec, measure

SHAPE = (3, 2, 16, 8)  # layers, kv heads, tokens, head dim


def _kv(dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(SHAPE, generator=g) * 2 + 0.5
    v = torch.randn(SHAPE, generator=g)
    return k.to(dtype), v.to(dtype)


def _roundtrip(name: str, x: torch.Tensor, which: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    codec = get_codec(name)
    parts = codec.encode(x, which)  # type: ignore[arg-type]
    out = torch.empty(x.shape, dtype=torch.float32)
    for layer in range(x.shape[0]):
        codec.decode_layer([p[layer] for p in parts], which, out[layer])  # type: ignore[arg-type]
    return out, parts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_raw_is_bitwise_lossless(dtype: torch.dtype) -> None:
    k, _ = _kv(dtype)
    parts = get_codec("raw").encode(k, "k")
    out = torch.empty_like(k)
    for layer in range(k.shape[0]):
        get_codec("raw").decode_layer([parts[0][layer]], "k", out[layer])
    assert torch.equal(out, k)


@pytest.mark.parametrize("which", ["k", "v"])
def test_fp8_error_within_e4m3_half_ulp(which: str) -> None:
    """e4m3 keeps 3 mantissa bits: a normal value is off by at most 2**-4 of itself; values
    in the subnormal range by at most half the smallest step (2**-10 of the scale)."""
    x = _kv()[0 if which == "k" else 1]
    out, parts = _roundtrip("fp8", x, which)
    scale = parts[1].float()
    bound = x.abs() * 2**-4 + scale * 2**-10 + 1e-6
    assert bool(((out - x).abs() <= bound).all())


@pytest.mark.parametrize("name,qmax", [("int8", 255), ("int4", 15)])
@pytest.mark.parametrize("which", ["k", "v"])
def test_int_error_within_half_step(name: str, qmax: int, which: str) -> None:
    """Asymmetric rounding: every value is within half a quantization step of its original."""
    x = _kv()[0 if which == "k" else 1]
    out, parts = _roundtrip(name, x, which)
    scale = parts[1].float()
    assert bool(((out - x).abs() <= scale * 0.5 * (1 + 1e-3) + 1e-5).all())
    # the step is the range of each group / qmax
    dim = 2 if which == "k" else 3
    rng = x.amax(dim=dim, keepdim=True) - x.amin(dim=dim, keepdim=True)
    assert torch.allclose(scale, rng / qmax, rtol=2e-3, atol=1e-6)


def test_kivi_axes_keys_per_channel_values_per_token() -> None:
    """An outlier key channel costs precision only in that channel (per-channel statistics);
    values keep one scale per token."""
    k, v = _kv()
    k[:, :, :, 3] *= 100.0
    out, parts = _roundtrip("int4", k, "k")
    assert parts[1].shape == (SHAPE[0], SHAPE[1], 1, SHAPE[3])
    err_other = (out - k)[..., [0, 1, 2, 4, 5, 6, 7]].abs().max()
    assert err_other < 0.5 * (k[..., 0].max() - k[..., 0].min()).item()
    assert (out - k)[..., 3].abs().max() > err_other  # the outlier channel has its own big step
    _, vparts = _roundtrip("int4", v, "v")
    assert vparts[1].shape == (SHAPE[0], SHAPE[1], SHAPE[2], 1)


def test_int4_packs_two_values_per_byte_and_needs_even_dim() -> None:
    k, _ = _kv()
    parts = get_codec("int4").encode(k, "k")
    assert parts[0].shape == (*SHAPE[:3], SHAPE[3] // 2) and parts[0].dtype == torch.uint8
    with pytest.raises(ValueError, match="even head_dim"):
        get_codec("int4").sections("k", (1, 1, 4, 5), torch.float32)


def test_constant_input_does_not_divide_by_zero() -> None:
    x = torch.full(SHAPE, 1.25)
    for name in CODECS:
        out, _ = _roundtrip(name, x, "v")
        assert torch.isfinite(out).all(), name
        assert torch.allclose(out, x, atol=1e-3), name


def test_measure_reports_ratio_and_error_in_order() -> None:
    g = torch.Generator().manual_seed(1)
    shape = (2, 2, 64, 32)  # statistics are amortized over 64 tokens / 32 channels
    k = torch.randn(shape, generator=g).to(torch.bfloat16)
    v = torch.randn(shape, generator=g).to(torch.bfloat16)
    reports = {name: measure(name, k, v) for name in ("raw", "fp8", "int8", "int4")}
    assert reports["raw"].ratio == 1.0 and reports["raw"].max_abs_error == 0.0
    assert reports["raw"].bytes_per_token == 2 * 2 * 2 * 2 * 32  # K+V, layers, heads, dim, bf16
    # bf16 -> one byte plus statistics: fp8 1 + 2/32 (+ 4/64 for keys) ...
    assert 1.7 < reports["fp8"].ratio < 2.0 and 1.6 < reports["int8"].ratio < 2.0
    assert 3.0 < reports["int4"].ratio < 4.0
    assert reports["int8"].value_rel_rmse < reports["fp8"].value_rel_rmse < 0.05
    assert reports["int4"].value_rel_rmse < 0.2
    assert reports["int8"].key_rel_rmse < reports["int4"].key_rel_rmse


def test_unknown_codec_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown codec"):
        get_codec("zstd")
