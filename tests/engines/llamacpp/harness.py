"""Running llama-cpp-python 0.3.36 for the tests: a context on a GGUF file, the last token's
logits, greedy steps, and a store made from another process (``python -m
tests.engines.llamacpp.harness store …``: a fresh process that evaluates a prompt and stores
its chunks, as a first session of a desktop assistant would)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp import Llama

from kvstrata.clients.llamacpp import KvstrataLlamaPrefix
from kvstrata.clients.sync import Client

N_CTX = 2048
N_BATCH = 512


def make_llm(model: Path, flash: bool, n_ctx: int = N_CTX) -> Llama:
    return Llama(
        str(model),
        n_ctx=n_ctx,
        n_batch=N_BATCH,
        flash_attn=flash,
        seed=0,
        verbose=False,
        n_threads=1,
    )


def last_logits(llm: Llama) -> np.ndarray:
    out = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(out, shape=(llm.n_vocab(),)).copy()


def greedy(llm: Llama, steps: int) -> list[int]:
    """``steps`` greedy tokens after the tokens evaluated so far."""
    out = []
    for _ in range(steps):
        tok = int(np.argmax(last_logits(llm)))
        out.append(tok)
        llm.eval([tok])
    return out


def prompt_tokens(llm: Llama, text: str, n: int) -> list[int]:
    """At least ``n`` tokens of ``text`` repeated, cut to ``n``."""
    toks = llm.tokenize(text.encode())
    while len(toks) < n:
        toks += llm.tokenize((" " + text).encode(), add_bos=False)
    return toks[:n]


def store_in_fresh_process(
    model: Path, port: int, flash: bool, tokens: list[int]
) -> dict[str, Any]:
    """Evaluate ``tokens`` in a new process and store its chunks; what it reports."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.engines.llamacpp.harness",
            "store",
            str(model),
            str(port),
            str(int(flash)),
        ],
        input=json.dumps(tokens),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"store process failed:\n{proc.stderr}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def _store_main(model: str, port: int, flash: bool) -> None:
    tokens = json.loads(sys.stdin.read())
    llm = make_llm(Path(model), flash)
    llm.eval(tokens)
    with Client(port=port) as client:
        prefix = KvstrataLlamaPrefix(llm, client)
        stored = prefix.store()
        print(json.dumps({"stored": stored, "namespace": prefix.namespace}))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["store"])
    ap.add_argument("model")
    ap.add_argument("port", type=int)
    ap.add_argument("flash", type=int)
    a = ap.parse_args()
    _store_main(a.model, a.port, bool(a.flash))
