"""``kvstrata simulate``: the capacity planner's command line (see docs/simulate.md).

``kvstrata simulate --trace FILE --dram SIZE --nvme SIZE [--gpu SIZE] [--s3] [--json]`` replays a
trace; ``--workload FILE.toml`` (and/or ``--set key=value``) generates one instead;
``--sweep dram=64GiB..2TiB[:N]`` repeats the run over N sizes (doubling by default) and prints
one row per size, ``--plot FILE.png`` draws the curve (needs matplotlib: the ``bench`` extra;
checked before the sweep: without it the table is still printed, with a warning, status 1).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

from kvstrata.config import format_size, parse_size
from kvstrata.sim.economics import MODELS, Model, hardware, model_from_config
from kvstrata.sim.replay import Plan, run
from kvstrata.sim.workload import Workload, load_workload
from kvstrata.tracefile import Event, TraceError, read_trace


class UsageError(ValueError):
    """Bad options: printed as ``kvstrata simulate: …`` with exit status 2."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvstrata simulate",
        description="Replay a trace or a generated workload through kvstrata's placement "
        "policy over virtual tiers: hit ratio per tier, TTFT, GPU time saved.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", metavar="FILE", help="JSON Lines trace (serve --trace-file)")
    src.add_argument("--workload", metavar="FILE.toml", help="workload parameters ([workload])")
    p.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="workload parameter (repeatable; implies a generated workload)",
    )
    p.add_argument("--dram", metavar="SIZE", help="DRAM tier size (e.g. 256GiB)")
    p.add_argument("--nvme", metavar="SIZE", help="NVMe tier size (0: no NVMe tier)")
    p.add_argument("--gpu", metavar="SIZE", help="GPU pool size (default: no GPU tier)")
    p.add_argument("--s3", action="store_true", help="add an unbounded S3 tier")
    p.add_argument(
        "--model",
        default="llama-3-70b",
        metavar="NAME|FILE.json",
        help=f"model preset ({', '.join(MODELS)}) or a transformers config.json",
    )
    p.add_argument(
        "--kv-bytes",
        type=float,
        default=2.0,
        metavar="N",
        help="bytes per KV element (2: bf16, 1: fp8/int8)",
    )
    p.add_argument("--gpu-type", default="h100", choices=("h100", "h200"))
    p.add_argument("--nvme-drives", default="1xgen5", choices=("1xgen5", "4xgen5"))
    p.add_argument("--network", default="100g", choices=("100g", "200g", "400g"))
    p.add_argument(
        "--hardware",
        metavar="local[:DIR]",
        help="measure this machine (about a second: CPU matmul rate, memory copies, a file "
        "in DIR, default the temp folder) instead of the --gpu-type/--nvme-drives/--network "
        "presets",
    )
    p.add_argument("--mfu", type=float, default=0.5, help="model FLOPs utilisation of prefill")
    p.add_argument(
        "--prefill-fit",
        metavar="MS,US[,US]",
        help="the engine's measured prefill instead of the FLOPs model: fixed ms per request, "
        "µs per token computed (and per token cached), e.g. as bench/bench_serving.py fits it",
    )
    p.add_argument(
        "--chunk-tokens",
        type=int,
        default=256,
        metavar="N",
        help="tokens per chunk for traces without token counts",
    )
    p.add_argument(
        "--prefetch-concurrency", type=int, default=4, metavar="N",
        help="the server's prefetch workers (config prefetch-concurrency)",
    )  # fmt: skip
    p.add_argument(
        "--prefetch-queue", type=int, default=1024, metavar="N",
        help="most queued prefetch requests (config prefetch-queue)",
    )  # fmt: skip
    p.add_argument(
        "--prefetch-bandwidth", default="0", metavar="SIZE",
        help="prefetch bytes per second, 0: no cap (config prefetch-bandwidth)",
    )  # fmt: skip
    p.add_argument("--sweep", metavar="TIER=LO..HI[:N]", help="e.g. dram=64GiB..2TiB")
    p.add_argument("--plot", metavar="FILE.png", help="with --sweep: draw the curve")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _size(text: str | None, what: str) -> int | None:
    if text is None:
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise UsageError(f"invalid {what}: {exc}") from None


def parse_sweep(text: str) -> tuple[str, list[int]]:
    """``dram=64GiB..2TiB[:N]`` → ("dram", sizes): N geometric steps (default: doublings)."""
    try:
        tier, rng = text.split("=", 1)
        rng, _, count = rng.partition(":")
        lo_s, hi_s = rng.split("..", 1)
        lo, hi = parse_size(lo_s), parse_size(hi_s)
    except ValueError:
        raise UsageError(
            f"invalid --sweep {text!r}: use TIER=LO..HI[:N], e.g. dram=64GiB..2TiB"
        ) from None
    if tier not in ("gpu", "dram", "nvme") or not 0 < lo <= hi:
        raise UsageError(f"invalid --sweep {text!r}: tier gpu, dram or nvme, 0 < LO <= HI")
    n = int(count) if count.isdigit() else int(math.log2(hi / lo)) + 1
    if n < 1 or n > 64:
        raise UsageError("invalid --sweep: 1 to 64 points")
    if n == 1:
        return tier, [lo]
    ratio = (hi / lo) ** (1 / (n - 1))
    return tier, [round(lo * ratio**i) for i in range(n)]


def _model(args: argparse.Namespace) -> Model:
    if args.model in MODELS:
        m = MODELS[args.model]
        return Model(m.name, m.params, m.layers, m.kv_heads, m.head_dim, args.kv_bytes)
    if Path(args.model).is_file():
        return model_from_config(args.model, args.kv_bytes)
    raise UsageError(f"unknown model {args.model!r}: {', '.join(MODELS)} or a config.json")


def _inputs(args: argparse.Namespace) -> tuple[list[Event] | None, Workload | None]:
    if args.trace:
        return list(read_trace(args.trace)), None
    overrides = dict(kv.split("=", 1) for kv in args.set if "=" in kv)
    if len(overrides) != len(args.set):
        raise UsageError("--set takes KEY=VALUE")
    if args.workload is None and not overrides:
        raise UsageError("give --trace FILE or --workload FILE.toml (or --set KEY=VALUE)")
    return None, load_workload(args.workload, overrides)


def _plan(args: argparse.Namespace, **sizes: int | None) -> Plan:
    dram = sizes.get("dram", _size(args.dram, "--dram"))
    nvme = sizes.get("nvme", _size(args.nvme, "--nvme"))
    gpu = sizes.get("gpu", _size(args.gpu, "--gpu"))
    if dram is None or nvme is None:
        raise UsageError("--dram SIZE and --nvme SIZE are required (or swept)")
    hw = args.measured or hardware(args.gpu_type, args.nvme_drives, args.network)
    return Plan(
        dram or None,
        nvme or None,
        gpu or None,
        args.s3,
        _model(args),
        hw,
        args.mfu,
        args.chunk_tokens,
        _prefill(args.prefill_fit),
        _positive(args.prefetch_concurrency, "--prefetch-concurrency"),
        _positive(args.prefetch_queue, "--prefetch-queue"),
        float(_size(args.prefetch_bandwidth, "--prefetch-bandwidth") or 0),
    )


def _positive(n: int, what: str) -> int:
    if n < 1:
        raise UsageError(f"invalid {what} {n}: must be at least 1")
    return n


def _prefill(text: str | None) -> Any:
    if text is None:
        return None
    from kvstrata.sim.ttft import parse_fit

    try:
        return parse_fit(text)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _measure(spec: str) -> Any:
    """``--hardware local[:DIR]``: this machine, measured (``kvstrata.sim.calibrate``)."""
    kind, _, folder = spec.partition(":")
    if kind != "local":
        raise UsageError(f"invalid --hardware {spec!r}: local or local:DIR")
    if folder and not Path(folder).is_dir():
        raise UsageError(f"invalid --hardware {spec!r}: {folder} is not a folder")
    from kvstrata.sim.calibrate import local_hardware

    hw = local_hardware(folder or None)
    links = ", ".join(
        f"{t} {bw / 1e9:.1f} GB/s {lat * 1e6:.0f} us" for t, (bw, lat) in hw.links.items()
    )
    print(f"measured {hw.name}: {hw.peak_flops / 1e9:.1f} GFLOP/s; {links}", file=sys.stderr)
    return hw


def _pct(ratio: float | None, width: int) -> str:
    return f"{'-':>{width}}" if ratio is None else f"{100 * ratio:>{width}.1f}"


def table(rep: dict[str, Any]) -> str:
    """The report of one run as text."""
    lines = [
        f"{rep['model']} on {rep['hardware']}, "
        + (f"prefill {rep['prefill']}" if rep.get("prefill") else f"MFU {rep['mfu']:.0%}")
        + f": {rep['requests']} "
        f"requests, {rep['chunk_ops']} chunk ops in {rep['seconds']} s "
        f"({rep['chunk_ops_per_second']:,}/s)",
        f"{'tier':<6}{'capacity':>12}{'hit %':>8}{'hits':>10}{'misses':>10}"
        f"{'promoted':>10}{'demoted':>10}{'evicted':>10}{'GB in':>10}{'GB out':>10}",
    ]
    for name, t in rep["tiers"].items():
        cap = format_size(int(t["capacity"])) if t["capacity"] else "unbounded"
        lines.append(
            f"{name:<6}{cap:>12}{_pct(t['hit_ratio'], 8)}{t['hits']:>10}{t['misses']:>10}"
            f"{t['promotions']:>10}{t['demotions']:>10}{t['evictions']:>10}"
            f"{t['bytes_in'] / 1e9:>10.1f}{t['bytes_out'] / 1e9:>10.1f}"
        )
    tt, gs, pf = rep["ttft"], rep["gpu_seconds"], rep["prefetch"]
    lines.append(
        f"tokens from cache {100 * rep['token_hit_ratio']:.1f} %; TTFT p50 "
        f"{tt['p50'] * 1e3:.1f} ms p99 {tt['p99'] * 1e3:.1f} ms (recompute p50 "
        f"{tt['recompute_p50'] * 1e3:.1f} ms p99 {tt['recompute_p99'] * 1e3:.1f} ms)"
    )
    lines.append(
        f"prefill GPU-seconds {gs['prefill']:.1f} of {gs['recompute']:.1f} "
        f"(saved {gs['saved']:.1f}); prefetched chunks {pf['chunks']} "
        f"(used timely {pf['timely']}, used late {pf['used_late']}; requests {pf['requests']}: "
        f"late {pf['late']}, dropped {pf['dropped']}, deduped {pf['deduped']}, "
        f"cancelled {pf['cancelled']})"
    )
    lines.append("links (GB): " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in rep["links"].items()))
    checked = rep.get("reads_checked") or {}
    if checked.get("reads"):
        lines.append(
            f"replayed reads served from the tier the server recorded: {checked['same']} of "
            f"{checked['reads']} ({100 * checked['same'] / checked['reads']:.1f} %)"
        )
    return "\n".join(lines)


def sweep_table(tier: str, rows: list[tuple[int, dict[str, Any]]]) -> str:
    head = (
        f"{tier + ' size':>12}{'token hit %':>12}"
        + "".join(f"{n + ' hit %':>11}" for n in rows[0][1]["tiers"])
        + f"{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'GPU-s saved':>13}"
    )
    out = [head]
    for size, rep in rows:
        out.append(
            f"{format_size(size):>12}{100 * rep['token_hit_ratio']:>12.1f}"
            + "".join(_pct(t["hit_ratio"], 11) for t in rep["tiers"].values())
            + f"{rep['ttft']['p50'] * 1e3:>13.1f}{rep['ttft']['p99'] * 1e3:>13.1f}"
            f"{rep['gpu_seconds']['saved']:>13.1f}"
        )
    return "\n".join(out)


def _sweep(args: argparse.Namespace, events: Any, wl: Any) -> list[tuple[int, dict[str, Any]]]:
    tier, sizes = parse_sweep(args.sweep)
    rows = []
    for i, size in enumerate(sizes):
        print(
            f"\rsweep {i + 1}/{len(sizes)}: {tier}={format_size(size)} ",
            end="",
            file=sys.stderr,
            flush=True,
        )
        rows.append((size, run(_plan(args, **{tier: size}), events, wl)))
    print(file=sys.stderr)
    return rows


def plot_problem(path: str) -> str | None:
    """Why ``--plot path`` could not be drawn (checked before any work), or None."""
    if importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib (pip install 'kvstrata[bench]'): no PNG will be written"
    folder = Path(path).resolve().parent
    if not folder.is_dir():
        return f"--plot: folder {folder} does not exist: no PNG will be written"
    return None


def plot(tier: str, rows: list[tuple[int, dict[str, Any]]], path: str) -> Path:
    """Draw the sweep (hit ratios, TTFT) into ``path``; the file written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [s / 2**30 for s, _ in rows]
    first = rows[0][1]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    fig.suptitle(f"kvstrata simulate: {tier} size sweep, {first['model']} on {first['hardware']}")
    a.plot(xs, [100 * r["token_hit_ratio"] for _, r in rows], "o-", label="tokens from cache")
    for name in first["tiers"]:
        ys = [r["tiers"][name]["hit_ratio"] for _, r in rows]
        a.plot(xs, [math.nan if y is None else 100 * y for y in ys], ".--", label=f"{name} hits")
    a.set(xscale="log", xlabel=f"{tier} size (GiB)", ylabel="hit ratio (%)",
          title="cache hits")  # fmt: skip
    a.legend()
    b.plot(xs, [r["ttft"]["p50"] * 1e3 for _, r in rows], "o-", label="TTFT p50")
    b.plot(xs, [r["ttft"]["p99"] * 1e3 for _, r in rows], "o-", label="TTFT p99")
    b.set(xscale="log", xlabel=f"{tier} size (GiB)", ylabel="time to first token (ms)",
          title="prefill with the cache")  # fmt: skip
    b.legend()
    fig.tight_layout()
    out = Path(path).resolve()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.plot and not args.sweep:
            raise UsageError("--plot draws a sweep: give --sweep TIER=LO..HI too")
        # optional dependencies before the work: a missing one costs a warning, not the sweep
        problem = plot_problem(args.plot) if args.plot else None
        if problem:
            print(f"kvstrata simulate: {problem}", file=sys.stderr)
        args.measured = _measure(args.hardware) if args.hardware else None
        events, wl = _inputs(args)
        if args.sweep:
            tier = parse_sweep(args.sweep)[0]
            rows = _sweep(args, events, wl)
            if args.json:
                print(json.dumps({"sweep": [{"size": s, **r} for s, r in rows]}))
            else:
                print(sweep_table(tier, rows))
            if args.plot and problem is None:
                print(f"plot written to {plot(tier, rows, args.plot)}", file=sys.stderr)
            elif problem:
                print(f"kvstrata simulate: {problem}", file=sys.stderr)
                return 1
            return 0
        rep = run(_plan(args), events, wl)
    except (UsageError, TraceError, ValueError, OSError) as exc:
        print(f"kvstrata simulate: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(rep) if args.json else table(rep))
    return 0
