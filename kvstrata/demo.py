"""``kvstrata demo``: a multi-turn conversation that reuses its own KV cache through kvstrata.

Starts an embedded server (``python -P -m kvstrata serve --port 0`` in a subprocess, importing
the very package this demo runs from — never a ``kvstrata/`` folder in the current directory —
with data in a temporary folder unless ``--data-dir``), builds a Llama-shaped model with random
weights (no download; token ids stand in for text), and runs turns of "history + new user
message → greedy reply". Each turn prints the tokens reused from the server, the tier they came
from and the time to first token next to a full recompute of the same prompt; a legend under
the table says what each column means. Needs the ``hf`` extra (torch, transformers, tqdm):
``kvstrata demo`` says so in one line when it is missing.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["EmbeddedServer", "TurnReport", "build_model", "main"]

_READY = re.compile(r"ready on .* port=(\d+)")
#: the folder holding the running ``kvstrata`` package, put first on the child's path
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)

LEGEND = """\
  turn          conversation turn (each adds a user message to the whole history)
  prompt        tokens of the prompt sent to the model this turn
  reused        leading tokens whose KV came back from kvstrata (whole chunks only)
  tier          where those chunks were found (tier:chunks)
  TTFT ms       time to first token with kvstrata: load the reused KV + prefill the rest
  recompute ms  time to first token recomputing the whole prompt (the baseline)
  speedup       recompute ms / TTFT ms"""


class EmbeddedServer:
    """``kvstrata serve`` in a subprocess on a free port; ``flags`` are config keys."""

    def __init__(self, data_dir: Path, **flags: Any) -> None:
        self.data_dir = data_dir
        self.flags = {"port": 0, "data-dir": str(data_dir), **flags}
        self.port = 0
        self._proc: subprocess.Popen[str] | None = None

    def start(self, timeout: float = 60.0) -> EmbeddedServer:
        # -P: the current folder is not put on sys.path (a clone's parent has a kvstrata/
        # folder that would shadow the package); PYTHONPATH names the package we run from.
        argv = [sys.executable, "-P", "-m", "kvstrata", "serve"]
        for key, value in self.flags.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        path = os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONPATH": path},
        )  # fmt: skip
        self._proc = proc
        assert proc.stdout is not None
        deadline, seen = time.monotonic() + timeout, []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            m = _READY.search(line)
            if m:
                self.port = int(m.group(1))
                threading.Thread(target=self._drain, daemon=True).start()
                return self
        self.stop()
        raise RuntimeError("kvstrata serve did not start:\n" + "".join(seen[-20:]))

    def _drain(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for _ in self._proc.stdout:
            pass

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def build_model(
    layers: int, hidden: int, heads: int, kv_heads: int, vocab: int = 32000, seed: int = 0
) -> Any:
    """A Llama-shaped model with random weights (GQA, SwiGLU MLP of ~2.75x hidden)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=65536,
    )
    return LlamaForCausalLM(config).eval()


@dataclass(frozen=True, slots=True)
class TurnReport:
    turn: int
    prompt_tokens: int
    reused_tokens: int
    tiers: str
    ttft_s: float
    recompute_s: float


def _tier_summary(tiers: tuple[str, ...]) -> str:
    if not tiers:
        return "-"
    counts: dict[str, int] = {}
    for t in tiers:
        counts[t] = counts.get(t, 0) + 1
    return ",".join(f"{t}:{n}" for t, n in counts.items())


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvstrata demo", description=__doc__.split("\n")[0])
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=1536, help="shared prompt prefix")
    p.add_argument("--user-tokens", type=int, default=128, help="new tokens per user turn")
    p.add_argument("--reply-tokens", type=int, default=16)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--codec", default="raw", choices=["raw", "fp8", "int8", "int4"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--connect", metavar="HOST:PORT", help="use a running server instead")
    p.add_argument("--data-dir", type=Path, help="server data folder (default: a temp dir)")
    p.add_argument("--dram-capacity", default="512MiB", help="embedded server's DRAM tier")
    p.add_argument("--no-recompute", action="store_true", help="skip the recompute baseline")
    if argv and argv[0] == "--":  # ``kvstrata demo -- --turns 3`` passes the separator on
        argv = argv[1:]
    return p.parse_args(argv)


def _run_turns(args: argparse.Namespace, client: Any) -> list[TurnReport]:
    import torch
    from tqdm import tqdm

    from kvstrata.clients.hf import HFPrefixCache

    heads = max(1, args.hidden // 64)
    print(f"building a Llama-shaped model: {args.layers} layers, hidden {args.hidden}, "
          f"{heads} heads, random weights (no download) ...", flush=True)  # fmt: skip
    started = time.perf_counter()
    model = build_model(args.layers, args.hidden, heads, max(1, heads // 4))
    print(f"model ready in {time.perf_counter() - started:.1f} s; running {args.turns} turns "
          f"of {args.user_tokens} new tokens after a {args.system_tokens}-token system prompt",
          flush=True)  # fmt: skip
    pc = HFPrefixCache(model, client, chunk_tokens=args.chunk_tokens, codec=args.codec)
    gen = torch.Generator().manual_seed(1)
    history = torch.randint(0, 32000, (1, args.system_tokens), generator=gen)
    reports: list[TurnReport] = []
    bar = tqdm(range(1, args.turns + 1), desc="turns", unit="turn")
    for turn in bar:
        user = torch.randint(0, 32000, (1, args.user_tokens), generator=gen)
        prompt = torch.cat([history, user], dim=1)
        recompute = 0.0
        if not args.no_recompute:
            bar.set_postfix_str("recomputing baseline")
            t0 = time.perf_counter()
            with torch.inference_mode():
                model(prompt, use_cache=True, logits_to_keep=1)
            recompute = time.perf_counter() - t0
        bar.set_postfix_str("generating")
        out = pc.generate(prompt, args.reply_tokens)
        pre = out.prefill
        tiers = _tier_summary(pre.tiers)
        row = TurnReport(turn, pre.prompt_tokens, pre.reused_tokens, tiers, pre.ttft_s, recompute)
        reports.append(row)
        history = torch.cat([prompt, torch.tensor([out.tokens])], dim=1)
        pc.wait_stored()  # the next turn's match should see this turn's chunks
    bar.close()
    pc.close()
    return reports


def _print(reports: list[TurnReport], args: argparse.Namespace) -> None:
    print(f"\nmodel: Llama-shaped, {args.layers} layers, hidden {args.hidden}, random weights, "
          f"chunk {args.chunk_tokens} tokens, codec {args.codec}")  # fmt: skip
    print(f"{'turn':>4} {'prompt':>7} {'reused':>7} {'tier':>14} {'TTFT ms':>9} "
          f"{'recompute ms':>13} {'speedup':>8}")  # fmt: skip
    for r in reports:
        speed = f"{r.recompute_s / r.ttft_s:7.1f}x" if r.recompute_s else "       -"
        rec = f"{r.recompute_s * 1e3:13.1f}" if r.recompute_s else f"{'-':>13}"
        print(f"{r.turn:>4} {r.prompt_tokens:>7} {r.reused_tokens:>7} {r.tiers:>14} "
              f"{r.ttft_s * 1e3:9.1f} {rec} {speed}")  # fmt: skip
    print(LEGEND)


#: the CPU build of the torch the test command pins (scripts/test.sh): PyPI's Linux wheel of
#: torch is the CUDA build, 5.7 GB with its NVIDIA libraries, which a CPU machine never uses
CPU_TORCH = "python3 -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"


def missing_extra() -> str | None:
    """The message when the ``hf`` extra is not installed, else None. Without torch it first
    says how to get the CPU build, before the user starts a multi-GB install."""
    for module in ("torch", "transformers", "tqdm"):
        try:
            __import__(module)
        except ImportError:
            message = (
                f"kvstrata demo needs the 'hf' extra ({module} is not installed): "
                "python3 -m pip install 'kvstrata[hf]' (from a clone: python3 -m pip install "
                "'.[hf]')"
            )
            if module == "torch":
                message += (
                    ".\nWithout an NVIDIA GPU, install the CPU build of torch first (the extra "
                    "would pull the CUDA build, 5.7 GB):\n  " + CPU_TORCH
                )
            return message
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvstrata demo``; returns the exit status."""
    args = _parse(argv)
    message = missing_extra()
    if message is not None:
        print(message, file=sys.stderr)
        return 2
    from kvstrata.clients.sync import Client

    if args.connect:
        host, _, port = args.connect.rpartition(":")
        with Client(host=host or "127.0.0.1", port=int(port)) as client:
            _print(_run_turns(args, client), args)
        return 0
    with tempfile.TemporaryDirectory(prefix="kvstrata-demo-") as tmp:
        data_dir = args.data_dir or Path(tmp)
        print(f"starting an embedded kvstrata server (DRAM {args.dram_capacity}) ...",
              flush=True)  # fmt: skip
        with (
            EmbeddedServer(data_dir, dram_capacity=args.dram_capacity) as server,
            Client(port=server.port) as client,
        ):
            print(f"embedded kvstrata server on 127.0.0.1:{server.port}, data in {data_dir}")
            _print(_run_turns(args, client), args)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
