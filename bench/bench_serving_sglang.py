"""Serving benchmark, SGLang contender: SGLang 0.5.23's real server on CPU (the test-only shims of
tests/engines/sglang_server), HiCache's host pool only vs host pool + kvstrata as L3.

Model: a random Llama (default hidden 512, 4 layers, KV heads 2 x 64, float32), wide enough
that prefill costs more than loading its KV (the test's tiny model recomputes 2,000 tokens in
about 0.2 s, less than HiCache's prefetch round trip).

Workload (the same kind as bench/bench_serving.py's): multi-turn conversations with think times.
Each conversation starts from its own long context (``--context`` tokens of words) and each turn
adds ``--turn`` new tokens plus the previous answer; ``--clients`` clients each drive their
share of the conversations round robin, sleeping a think time (exponential, mean ``--think``
seconds, seeded) between turns. The conversations together hold more tokens than SGLang's device
pool (``--device-tokens``) and host pool (twice that) can keep, so a conversation's prefix has
fallen out of both by its next turn: with the host pool only it is recomputed; with kvstrata it
comes back from L3. TTFT is measured on SGLang's streaming ``/generate`` (first chunk that
carries a token). The first turn of each conversation (a cold prompt in both runs) is left out
of the percentiles. Prints one table.

Runs in the SGLang server venv (``scripts/engines/sglang-server.sh --install-only`` builds it)::

    ~/.cache/kvstrata/venvs/sglang-server-0.5.23/bin/python bench/bench_serving_sglang.py
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib import request

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import free_port, start_process_server  # noqa: E402
from tests.engines.sglang_server.harness import SGLangServer, launch  # noqa: E402
from tests.engines.sglang_server.tiny_model import words, write_model  # noqa: E402


@dataclass(frozen=True)
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int
    ttft_s: float
    cached: int
    storage: int


def stream_ttft(srv: SGLangServer, text: str, out_tokens: int) -> tuple[float, str, dict]:
    """(TTFT, the answer's text, the last chunk's meta_info) of one streamed request."""
    body = json.dumps({
        "text": text,
        "sampling_params": {"temperature": 0, "max_new_tokens": out_tokens, "ignore_eos": True},
        "stream": True,
    }).encode()  # fmt: skip
    req = request.Request(f"{srv.url}/generate", data=body,
                          headers={"Content-Type": "application/json"})  # fmt: skip
    start = time.perf_counter()
    ttft, last = None, {}
    with request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if ttft is None and chunk.get("meta_info", {}).get("completion_tokens", 0) > 0:
                ttft = time.perf_counter() - start
            last = chunk
    assert ttft is not None, "no token streamed"
    return ttft, str(last.get("text", "")), dict(last.get("meta_info", {}))


def run_workload(srv: SGLangServer, args: argparse.Namespace) -> list[Turn]:
    turns: list[Turn] = []
    lock = threading.Lock()

    def client(cid: int) -> None:
        rng = random.Random(1000 + cid)
        mine = list(range(cid, args.conversations, args.clients))
        history = {c: words(args.context, seed=c) for c in mine}
        for t in range(args.turns):
            for c in mine:
                if t:
                    history[c] += " " + words(args.turn, seed=10_000 * (t + 1) + c)
                ttft, text, meta = stream_ttft(srv, history[c], args.out_tokens)
                history[c] += " " + text.strip()
                details = meta.get("cached_tokens_details") or {}
                with lock:
                    turns.append(Turn(c, t, int(meta.get("prompt_tokens", 0)), ttft,
                                      int(meta.get("cached_tokens", 0)),
                                      int(details.get("storage", 0))))  # fmt: skip
                time.sleep(rng.expovariate(1 / args.think) if args.think > 0 else 0)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return turns


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--context", type=int, default=1600, help="first-turn tokens per conversation")
    p.add_argument("--turn", type=int, default=200, help="new user tokens per later turn")
    p.add_argument("--out-tokens", type=int, default=8)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--think", type=float, default=0.5, help="mean think time, seconds")
    p.add_argument("--device-tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=512, help="model width (heads of 64)")
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-serving-sglang-"))
    model = write_model(work / "llama", hidden=args.hidden, layers=args.layers,
                        intermediate=args.hidden * 11 // 4)  # fmt: skip
    rows = []
    for label, with_l3 in (("HiCache host pool only", False), ("+ kvstrata L3", True)):
        kv = (
            start_process_server(work / f"kv-{with_l3}", dram_capacity="512MiB")
            if with_l3
            else None
        )
        url = f"redis://127.0.0.1:{kv.port}" if kv else None
        srv = launch(model, free_port(), work, name=f"sglang-{with_l3}", kv_url=url,
                     max_total_tokens=args.device_tokens)  # fmt: skip
        try:
            srv.wait_ready()
            turns = run_workload(srv, args)
        finally:
            srv.stop()
            if kv is not None:
                kv.stop()
        later = [t for t in turns if t.turn > 0]
        ttfts = [t.ttft_s for t in later]
        rows.append((label, len(later), pct(ttfts, 0.5), pct(ttfts, 0.99), statistics.mean(ttfts),
                     sum(t.cached for t in later) / max(1, sum(t.prompt_tokens for t in later)),
                     sum(t.storage for t in later)))  # fmt: skip
    print(f"\nSGLang 0.5.23 on CPU, random Llama (hidden {args.hidden}, {args.layers} layers, "
          f"KV heads 2x64), {args.conversations} conversations x {args.turns} "
          f"turns ({args.context}+{args.turn}/turn tokens), {args.clients} clients, think "
          f"{args.think}s, device pool {args.device_tokens} tokens, host pool x2")  # fmt: skip
    print(f"{'config':<24} {'turns':>5} {'TTFT p50':>9} {'TTFT p99':>9} {'mean':>7} "
          f"{'cached':>7} {'L3 tok':>7}")  # fmt: skip
    for label, n, p50, p99, mean, cached, l3 in rows:
        print(f"{label:<24} {n:>5} {p50:>8.3f}s {p99:>8.3f}s {mean:>6.3f}s {cached:>6.0%} {l3:>7}")
    print("(later turns only; the first turn of each conversation is cold in both runs)")


if __name__ == "__main__":
    main()
