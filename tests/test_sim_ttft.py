"""The engine's fitted prefill (``kvstrata.sim.ttft``): the least-squares fit recovers a known
engine, degrades to two terms when the cached tokens carry no information, refuses bad
``--prefill-fit`` text, and replaces the FLOPs model in ``kvstrata simulate``'s TTFT."""

from __future__ import annotations

import json
import random

import pytest

from kvstrata.cli import main as cli_main
from kvstrata.sim.ttft import PrefillFit, fit, parse_fit


def test_fit_recovers_a_known_engine_from_noisy_requests() -> None:
    """Requests of an engine with 40 ms fixed, 500 µs per computed and 20 µs per cached token,
    each ±1 ms of noise: the fit is within 5 % of each figure."""
    rng = random.Random(1)
    truth = PrefillFit(0.040, 500e-6, 20e-6)
    samples = []
    for _ in range(60):
        computed, cached = rng.randint(16, 2500), rng.choice((0, rng.randint(32, 3000)))
        noise = rng.uniform(-1e-3, 1e-3)
        samples.append((computed, cached, truth.seconds(computed, cached) + noise))
    got = fit(samples)
    assert got.fixed == pytest.approx(truth.fixed, rel=0.05)
    assert got.per_token == pytest.approx(truth.per_token, rel=0.05)
    assert got.per_cached == pytest.approx(truth.per_cached, rel=0.05, abs=2e-6)
    assert got.rate == pytest.approx(2000, rel=0.05)


def test_fit_without_cached_tokens_has_two_terms() -> None:
    samples = [(n, 0, 0.010 + n * 1e-3) for n in (100, 400, 900, 1600)]
    got = fit(samples)
    assert (got.fixed, got.per_token, got.per_cached) == pytest.approx((0.010, 1e-3, 0.0))
    with pytest.raises(ValueError, match="at least two"):
        fit(samples[:1])


def test_parse_fit() -> None:
    assert parse_fit("20,300") == PrefillFit(0.020, 300e-6, 0.0)
    assert parse_fit("20, 300, 5") == PrefillFit(0.020, 300e-6, 5e-6)
    for bad in ("20", "a,b", "1,2,3,4", "-1,3"):
        with pytest.raises(ValueError, match="prefill-fit"):
            parse_fit(bad)


def test_cli_prefill_fit_replaces_the_flops_model(capsys: pytest.CaptureFixture[str]) -> None:
    """The same workload with ``--prefill-fit 100,1000`` (100 ms + 1 ms a token computed): the
    recompute p50 is then exactly that line at the p50 prompt, above the H100 FLOPs
    model's, and a bad fit is a usage error."""
    args = ["simulate", "--set", "duration=20", "--set", "seed=3", "--dram", "64GiB",
            "--nvme", "256GiB", "--json"]  # fmt: skip
    assert cli_main(args) == 0
    flops = json.loads(capsys.readouterr().out)
    assert cli_main([*args, "--prefill-fit", "100,1000"]) == 0
    fitted = json.loads(capsys.readouterr().out)
    assert fitted["prefill"].startswith("100.0 ms + 1000 µs/token")
    assert fitted["ttft"]["recompute_p50"] > 2 * flops["ttft"]["recompute_p50"]
    tokens = (fitted["ttft"]["recompute_p50"] - 0.1) / 1e-3
    assert tokens == pytest.approx(round(tokens)) and tokens > 256
    assert cli_main([*args, "--prefill-fit", "x"]) == 2
    assert "prefill-fit" in capsys.readouterr().err
