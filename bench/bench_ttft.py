"""Time to first token on CPU: recompute vs a prefix restored from kvstrata's DRAM and NVMe tiers.

A Llama-shaped model with random weights (default: 4 layers, hidden 1024, 8 query heads and
2 KV heads of 128, SwiGLU 2816, vocab 32000, float32; ~111 M parameters), big enough that
prefill dominates. For each prompt length:

* **recompute**: the whole prompt through the model (the first run, which also stores its chunks);
* **dram**: the same prompt again, the prefix restored from the DRAM tier (best of 3);
* **nvme**: after a restart of the server (write-through NVMe, DRAM empty), the first run
  restores from NVMe (O_DIRECT reads, so not from the page cache); best of 3 restarts.

The machine is shared, so single runs are noisy; restores take best of 3, recompute is one run.

TTFT = match + load + prefill of the uncached rest (>= 1 token) and the next-token logits.
At the middle length, the lossy codecs are also restored from DRAM (chunks encoded from the
same KV). S3 is not measured here (not configured on this machine). Prints a table, the bytes
per token of each codec on the model's real KV, and writes ``bench/out/ttft.png``.

    python bench/bench_ttft.py [--lengths 2048,8192,16384] [--layers 4] [--hidden 1024]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvstrata.clients.codecs import CODECS, measure
from kvstrata.clients.hf import HFPrefixCache, PrefillResult
from kvstrata.clients.layout import ChunkLayout, packed_size
from kvstrata.clients.sync import Client
from kvstrata.demo import EmbeddedServer, build_model


@dataclass(frozen=True, slots=True)
class Row:
    tokens: int
    source: str
    ttft_s: float
    reused: int
    tiers: str
    load_s: float
    compute_s: float


def _row(tokens: int, source: str, r: PrefillResult) -> Row:
    tiers = ",".join(sorted(set(r.tiers))) or "-"
    return Row(tokens, source, r.ttft_s, r.reused_tokens, tiers, r.load_s, r.compute_s)


def _prompt(n: int) -> torch.Tensor:
    return torch.randint(0, 32000, (1, n), generator=torch.Generator().manual_seed(n))


def _measure_cold(pc: HFPrefixCache, lengths: list[int]) -> list[Row]:
    rows = []
    for n in lengths:
        print(f"  recompute {n} tokens ...", flush=True)
        rows.append(_row(n, "recompute", pc.prefill(_prompt(n))))
        pc.wait_stored()
        best = min((pc.prefill(_prompt(n), store=False) for _ in range(3)), key=lambda r: r.ttft_s)
        rows.append(_row(n, "dram", best))
    return rows


def _measure_after_restart(pc: HFPrefixCache, lengths: list[int]) -> list[Row]:
    rows = []
    for n in lengths:
        first = pc.prefill(_prompt(n), store=False)
        rows.append(_row(n, "nvme", first))
    return rows


def _codec_table(pc: HFPrefixCache, n: int) -> list[str]:
    cache = pc.prefill(_prompt(n), store=False).cache
    keys = torch.stack([layer.keys[0] for layer in cache.layers])  # type: ignore[union-attr,index]
    values = torch.stack([layer.values[0] for layer in cache.layers])  # type: ignore[union-attr,index]
    lines = [f"{'codec':>6} {'bytes/token':>12} {'w/ header':>10} {'ratio':>6} "
             f"{'K rel.rmse':>11} {'V rel.rmse':>11}"]  # fmt: skip
    for name in CODECS:
        rep = measure(name, keys, values)
        g = pc.geometry
        layout = ChunkLayout(g.layers, g.kv_heads, g.head_dim, pc.chunk_tokens, g.dtype, name)
        per_chunk = packed_size(layout)
        per_token = per_chunk / pc.chunk_tokens
        lines.append(f"{name:>6} {rep.bytes_per_token:12.0f} {per_token:10.0f} {rep.ratio:6.2f} "
                     f"{rep.key_rel_rmse:11.2e} {rep.value_rel_rmse:11.2e}")  # fmt: skip
    return lines


def _codec_ttft(model: Any, kv: Client, pc: HFPrefixCache, n: int) -> list[Row]:
    """TTFT from DRAM of each lossy codec at ``n`` tokens; chunks encoded from the raw KV."""
    ids = _prompt(n)
    cache = pc.prefill(ids, store=False).cache
    rows = []
    for name in ("fp8", "int8", "int4"):
        other = HFPrefixCache(model, kv, chunk_tokens=pc.chunk_tokens, codec=name)
        other.store(ids, cache)
        other.wait_stored()
        best = min((other.prefill(ids, store=False) for _ in range(3)), key=lambda r: r.ttft_s)
        rows.append(_row(n, f"dram {name}", best))
        other.close()
    return rows


def _plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r.tokens for r in rows})
    sources = ["recompute", "dram", "nvme"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.27
    for i, src in enumerate(sources):
        ys = [next((r.ttft_s for r in rows if r.tokens == n and r.source == src), 0.0)
              for n in lengths]  # fmt: skip
        xs = [j + (i - 1) * width for j in range(len(lengths))]
        bars = ax.bar(xs, ys, width, label=src)
        ax.bar_label(bars, labels=[f"{y:.2f}s" if y >= 1 else f"{y * 1e3:.0f}ms" for y in ys],
                     fontsize=7)  # fmt: skip
    ax.set_yscale("log")
    ax.set_xticks(range(len(lengths)), [f"{n // 1024}k" for n in lengths])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (s, log)")
    ax.set_title("TTFT on CPU: recompute vs restored from kvstrata")
    ax.legend(loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def _print_table(rows: list[Row]) -> None:
    print(f"\n{'tokens':>7} {'source':>10} {'TTFT s':>9} {'speedup':>8} {'reused':>7} "
          f"{'tiers':>6} {'load s':>8} {'compute s':>10}")  # fmt: skip
    base = {r.tokens: r.ttft_s for r in rows if r.source == "recompute"}
    order = ["recompute", "dram", "nvme", "dram fp8", "dram int8", "dram int4"]
    for r in sorted(rows, key=lambda r: (r.tokens, order.index(r.source))):
        print(f"{r.tokens:>7} {r.source:>10} {r.ttft_s:9.3f} {base[r.tokens] / r.ttft_s:7.1f}x "
              f"{r.reused:>7} {r.tiers:>6} {r.load_s:8.3f} {r.compute_s:10.3f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="2048,8192,16384")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--nvme-rounds", type=int, default=3, help="restarts; best one is shown")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    model = build_model(args.layers, args.hidden, args.heads, args.kv_heads)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"model: {args.layers} layers, hidden {args.hidden}, {args.heads}/{args.kv_heads} heads,"
          f" {params:.0f} M params, float32, {torch.get_num_threads()} threads")  # fmt: skip
    flags = {"dram-capacity": "1GiB", "nvme-capacity": "4GiB", "nvme-write-policy": "write-through"}
    with tempfile.TemporaryDirectory(prefix="kvstrata-ttft-") as tmp:
        data = Path(tmp)
        with EmbeddedServer(data, **flags) as srv, Client(port=srv.port) as kv:
            pc = HFPrefixCache(model, kv, chunk_tokens=args.chunk_tokens)
            print(
                f"KV: {pc.geometry.raw_bytes_per_token} bytes/token raw; namespace {pc.namespace}"
            )
            rows = _measure_cold(pc, lengths)
            codec_lines = _codec_table(pc, lengths[0])
            codec_rows = _codec_ttft(model, kv, pc, lengths[len(lengths) // 2])
            pc.close()
        nvme: list[Row] = []
        for i in range(args.nvme_rounds):
            print(
                f"  restart {i + 1}/{args.nvme_rounds} (DRAM empty, chunks on NVMe) ...", flush=True
            )
            with EmbeddedServer(data, **flags) as srv, Client(port=srv.port) as kv:
                pc = HFPrefixCache(model, kv, chunk_tokens=args.chunk_tokens)
                nvme += _measure_after_restart(pc, lengths)
                pc.close()
    rows += [min((r for r in nvme if r.tokens == n), key=lambda r: r.ttft_s) for n in lengths]
    _print_table(rows + codec_rows)
    print(f"\ncodecs on this model's KV ({lengths[0]} tokens):")
    print("\n".join(codec_lines))
    _plot(rows, args.out / "ttft.png")
    print(f"\nplot: {args.out / 'ttft.png'}")
    return 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    code = main()
    print(f"total {time.perf_counter() - t0:.0f} s")
    sys.exit(code)
