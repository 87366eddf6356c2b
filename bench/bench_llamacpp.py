"""llama.cpp (llama-cpp-python 0.3.36) time to first token: recomputing the prompt, restoring
it from kvstrata (DRAM, and NVMe after a server restart), and llama-cpp-python's own prompt
caches, ``LlamaRAMCache`` and ``LlamaDiskCache``, measured side by side in one run.

Run in the llama.cpp venv (``scripts/engines/llamacpp.sh --install-only`` makes it)::

    PYTHONPATH=$PWD KVSTRATA_LLAMACPP_CONVERTER=~/.cache/kvstrata/wheels/\\
    llama_cpp_python-0.3.36-src/vendor/llama.cpp/convert_hf_to_gguf.py \\
    ~/.cache/kvstrata/venvs/llamacpp-0.3.36/bin/python bench/bench_llamacpp.py

The model is a random Llama built and converted locally (``tests/engines/llamacpp/model.py``;
default 4 layers, hidden 256, f16). Prompts of ``k × 256 + 1`` tokens, so every route computes
exactly one token after loading (kvstrata restores the full chunks, llama-cpp-python's caches
hold the whole prompt and replay its last token). TTFT = load + that token's logits; the first
row of each length is the full prefill. Median (and fastest) of ``--rounds`` alternating
rounds; the NVMe route is one restore after a restart.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llama_cpp import Llama
from llama_cpp.llama_cache import LlamaDiskCache, LlamaRAMCache

from kvstrata.clients.llamacpp import KvstrataLlamaPrefix
from kvstrata.clients.sync import Client
from tests.conftest import start_process_server
from tests.engines.llamacpp.harness import prompt_tokens
from tests.engines.llamacpp.model import Shape, build_gguf

ROUTES = ("recompute", "kvstrata dram", "kvstrata nvme*", "LlamaRAMCache", "LlamaDiskCache")


def cold(llm: Llama) -> None:
    llm.reset()
    llm._ctx.kv_cache_seq_rm(-1, 0, -1)


def ttft(llm: Llama, load: Callable[[], int], tokens: list[int]) -> float:
    cold(llm)
    t0 = time.perf_counter()
    n = load()
    llm.eval(tokens[n:])
    return time.perf_counter() - t0


def from_llama_cache(llm: Llama, cache: LlamaRAMCache | LlamaDiskCache, tokens: list[int]) -> int:
    state = cache[tokens]
    llm.load_state(state)
    llm.n_tokens = len(tokens) - 1  # replay the last token, as Llama.generate does
    llm._ctx.kv_cache_seq_rm(-1, llm.n_tokens, -1)
    return llm.n_tokens


def one_round(
    llm: Llama,
    prefix: KvstrataLlamaPrefix,
    ram: LlamaRAMCache,
    disk: LlamaDiskCache,
    tokens: list[int],
) -> dict[str, float]:
    """TTFT of every in-memory route once, alternating."""
    return {
        "recompute": ttft(llm, lambda: 0, tokens),
        "kvstrata dram": ttft(llm, lambda: prefix.restore(tokens), tokens),
        "LlamaRAMCache": ttft(llm, lambda: from_llama_cache(llm, ram, tokens), tokens),
        "LlamaDiskCache": ttft(llm, lambda: from_llama_cache(llm, disk, tokens), tokens),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-llamacpp-"))
    shape = Shape(hidden=a.hidden, layers=a.layers, heads=4, kv_heads=2, ffn=a.hidden * 3,
                  ctx=16384)  # fmt: skip
    model = build_gguf(work, shape)
    lengths = [int(x) for x in a.lengths.split(",")]
    llm = Llama(str(model), n_ctx=max(lengths) + 256, n_batch=512, flash_attn=True,
                n_threads=a.threads, verbose=False)  # fmt: skip
    data = work / "kv"
    srv = start_process_server(data, dram_capacity="1GiB", nvme_capacity="2GiB",
                               nvme_write_policy="write-through")  # fmt: skip
    rows: dict[tuple[int, str], list[float]] = {}
    try:
        for length in lengths:
            tokens = prompt_tokens(llm, "the project cache keeps context warm", length + 1)
            cold(llm)
            llm.eval(tokens)
            ram, disk = LlamaRAMCache(1 << 34), LlamaDiskCache(str(work / f"disk{length}"))
            ram[tokens] = llm.save_state()
            with Client(port=srv.port) as c:
                prefix = KvstrataLlamaPrefix(llm, c)
                prefix.store()
                for _ in range(a.rounds):
                    disk[tokens] = ram[tokens]  # LlamaDiskCache pops what it returns
                    for route, t in one_round(llm, prefix, ram, disk, tokens).items():
                        rows.setdefault((length, route), []).append(t)
            srv.stop()  # the next restore reads every chunk from NVMe
            srv = start_process_server(data, dram_capacity="1GiB", nvme_capacity="2GiB",
                                       nvme_write_policy="write-through")  # fmt: skip
            with Client(port=srv.port) as c:
                prefix = KvstrataLlamaPrefix(llm, c)
                t = ttft(llm, lambda: prefix.restore(tokens), tokens)  # noqa: B023
                rows[(length, "kvstrata nvme*")] = [t]
    finally:
        srv.stop()
    print(f"llama-cpp-python 0.3.36, {shape.name}, f16 KV, flash attention, "
          f"{a.threads} threads; median of {a.rounds} (* one restore after a restart)")  # fmt: skip
    print(f"{'tokens':>7} {'route':<16} {'TTFT s':>8} {'min s':>8} {'vs recompute':>13}")
    for length in lengths:
        base = statistics.median(rows[(length, "recompute")])
        for route in ROUTES:
            t = statistics.median(rows[(length, route)])
            low = min(rows[(length, route)])
            print(f"{length + 1:>7} {route:<16} {t:>8.3f} {low:>8.3f} {base / t:>12.1f}x")


if __name__ == "__main__":
    main()
