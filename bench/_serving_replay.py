"""The serving benchmark's trace replayed (``bench_serving.py --trace-file``): what the server
counted beside what ``kvstrata simulate``'s engine predicts at the same capacities, and the TTFT
models beside the TTFT the client measured.

A run saves ``PATH.run.json`` beside its trace ``PATH`` (the server's KV.STATS, the capacities,
every request each contender served), so ``bench_serving.py --from-trace PATH`` prints the
comparison again without starting vLLM.

- reads: the share of chunk reads each tier served (a leased chunk counts where it was found,
  before its promotion into DRAM, on both sides), and the chunks missed everywhere;
- the tiers' promotions, demotions and evictions;
- TTFT, p50 and p99 over the kvstrata contender's workload requests: measured by the client;
  the FLOPs model of ``kvstrata simulate`` (this machine's numpy rate at MFU 50 %, the tiny
  model's config) over the replay's requests; and the engine's own prefill fitted
  (:mod:`kvstrata.sim.ttft`) to the no-connector ``vllm`` contender's requests of the same run,
  applied to each kvstrata request (its computed and cached tokens as vLLM reported them) plus
  the load of its cached chunks at the replay's tier mix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CHUNK_TOKENS = 32  # one block of the tiny model
CHUNK_BYTES = 128 << 10


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _workload(contender: dict[str, Any]) -> list[tuple[int, int, float]]:
    """(prompt, cached, TTFT) of a contender's workload requests (runs saved before requests
    carried their phase: the first ``len(ttft)``)."""
    reqs = contender["requests"]
    if reqs and len(reqs[0]) > 3:
        return [(r[0], r[1], r[2]) for r in reqs if r[3] == "workload"]
    return [(r[0], r[1], r[2]) for r in reqs[: len(contender["ttft"])]]


def save_run(
    trace: Path, stats: dict, dram: int, nvme: int, model_dir: Path, results: dict[str, Any]
) -> Path:
    """Write ``trace``'s ``.run.json``: what :func:`compare_saved` needs besides the trace."""
    out = trace.with_name(trace.name + ".run.json")
    data = {
        "stats": stats,
        "dram": dram,
        "nvme": nvme,
        "model_dir": str(model_dir),
        "contenders": {
            name: {"requests": r.requests, "ttft": r.ttft, "returning": r.returning}
            for name, r in results.items()
        },
    }
    out.write_text(json.dumps(data, default=str))
    return out


def _replay(trace: Path, dram: int, nvme: int, hw: Any) -> tuple[Any, list[Any]]:
    from kvstrata.config import OPTIONS
    from kvstrata.sim.engine import Simulator
    from kvstrata.sim.replay import Plan, replay, tier_specs
    from kvstrata.tracefile import read_trace

    vals = {o.name: o.default for o in OPTIONS}
    sim = Simulator(tier_specs(Plan(dram, nvme), hw, vals), int(vals["prefetch-concurrency"]))
    events = list(read_trace(trace))
    replay(sim, events)
    return sim, events


def compare_saved(trace: Path) -> list[str]:
    from kvstrata.sim.calibrate import local_hardware
    from kvstrata.sim.economics import load_seconds, model_from_config
    from kvstrata.sim.replay import Plan, report
    from kvstrata.sim.ttft import fit
    from tests.simshapes import shares

    run = json.loads(trace.with_name(trace.name + ".run.json").read_text())
    stats, dram, nvme = run["stats"], int(run["dram"]), int(run["nvme"])
    hw = local_hardware(trace.parent)
    sim, events = _replay(trace, dram, nvme, hw)
    ops: dict[str, int] = {}
    for ev in events:
        ops[ev.op] = ops.get(ev.op, 0) + 1
    simulated = {t.name: t.counters.as_dict() for t in sim.tiers}
    server, model = shares(stats, ["dram", "nvme"]), shares(simulated, ["dram", "nvme"])
    lines = [
        f"kvstrata DRAM {dram >> 20} MiB, NVMe {nvme >> 20} MiB; trace: {len(events)} records "
        + ", ".join(f"{k} {v}" for k, v in sorted(ops.items())),
        "",
        "| chunk reads served by | server (KV.STATS) | simulator (replayed trace) | gap (points) |",
        "|---|---|---|---|",
    ]
    for k in server:
        gap = abs(server[k] - model[k])
        lines.append(f"| {k} | {server[k]:.1f} % | {model[k]:.1f} % | {gap:.1f} |")
    for tier in ("dram", "nvme"):
        for counter in ("promotions", "demotions", "evictions"):
            a, b = int(stats[tier][counter]), int(simulated[tier][counter])
            lines.append(f"| {tier} {counter} (chunks) | {a} | {b} | {b - a:+d} |")

    tiny = model_from_config(Path(run["model_dir"]) / "config.json", 4.0)  # float32 KV
    plan = Plan(dram, nvme, model=tiny, hardware=hw, mfu=0.5, chunk_tokens=CHUNK_TOKENS)
    rep = report(sim, plan, 1.0, 0)
    contenders = run["contenders"]
    kv = contenders["vllm+kvstrata"]
    rows = [
        ("measured by the client", _pct(kv["ttft"], 0.5), _pct(kv["ttft"], 0.99), ""),
        (
            f"FLOPs model, replay ({hw.peak_flops / 1e9:.0f} GFLOP/s numpy, MFU 50 %)",
            rep["ttft"]["p50"],
            rep["ttft"]["p99"],
            f"{rep['requests']} KV.MATCH requests of the trace",
        ),
    ]
    base = contenders.get("vllm")
    fitted = ""
    if base and len(base["requests"]) >= 2:
        prefill = fit([(r[0] - r[1], r[1], r[2]) for r in base["requests"]])
        fitted = prefill.describe()
        # one cached chunk's load at the replay's mix of tiers (DRAM hits, NVMe hits)
        hits = {t: float(simulated[t]["hits"]) for t in ("dram", "nvme")}
        total = sum(hits.values()) or 1.0
        per_chunk = sum(h / total * load_seconds(CHUNK_BYTES, hw.links[t]) for t, h in hits.items())
        mine = _workload(kv)
        predicted = [prefill.seconds(p - c, c) + c / CHUNK_TOKENS * per_chunk for p, c, _ in mine]
        self_check = [prefill.seconds(p - c, c) for p, c, _ in _workload(base)]
        over = f"each request's computed/cached tokens; {per_chunk * 1e6:.0f} µs a chunk loaded"
        name = "engine prefill fitted to the `vllm` contender + loads at the replay's tier mix"
        rows.append((name, _pct(predicted, 0.5), _pct(predicted, 0.99), over))
        there = f"{_pct(base['ttft'], 0.5) * 1e3:.0f} / {_pct(base['ttft'], 0.99) * 1e3:.0f} ms"
        name = "(the same fit on the `vllm` contender's own requests)"
        rows.append((name, _pct(self_check, 0.5), _pct(self_check, 0.99), f"measured {there}"))
        # what the model leaves out, per chunk the kvstrata contender loaded (its requests
        # with cached tokens): the connector's own work (KV.MATCH, a scheduler step, the
        # lease, copies into vLLM's blocks) and what the fit cannot see
        loaded = [
            (t - q, c / CHUNK_TOKENS) for (_, c, t), q in zip(mine, predicted, strict=True) if c
        ]
        if loaded:
            residual = sum(r for r, _ in loaded) / sum(n for _, n in loaded)
            rows.append(
                (
                    "(measured − fitted, kvstrata requests that loaded chunks, mean)",
                    sum(r for r, _ in loaded) / len(loaded),
                    float("nan"),
                    f"{residual * 1e3:.1f} ms per chunk loaded",
                )
            )
    lines += [
        "",
        "| TTFT of the kvstrata contender | p50 ms | p99 ms | over |",
        "|---|---|---|---|",
    ]
    for name, p50, p99, over in rows:
        p99_text = "" if p99 != p99 else f"{p99 * 1e3:.0f}"  # (nan: not a distribution)
        lines.append(f"| {name} | {p50 * 1e3:.0f} | {p99_text} | {over} |")
    if fitted:
        lines.append(
            f"\nprefill fitted to the `vllm` contender's {len(base['requests'])} requests: {fitted}"
        )
    else:
        lines.append("\n(no `vllm` contender in this run: run it too for the fitted prefill model)")
    return lines
