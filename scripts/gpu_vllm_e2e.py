"""End-to-end check of the vLLM tier on a GPU machine: ``vllm serve`` with a small local model,
the OffloadingConnector + TieringOffloadingSpec and kvstrata as its secondary tier.

    python3 scripts/gpu_vllm_e2e.py --model /models/Qwen3-0.6B [--python /venv/bin/python]

Starts ``kvstrata serve`` and ``vllm serve`` (``VLLM_SERVER_DEV_MODE=1`` for its cache-reset
endpoint) on free loopback ports, sends a long prompt (streamed, greedy) and times its first
token, waits until kvstrata holds the prompt's chunks, resets vLLM's GPU prefix cache and its
CPU tier (``POST /reset_prefix_cache?reset_external=true``), sends the same prompt again and
times it. Passes when the second request was served from kvstrata (its lease hits grew) and
produced the same tokens. Prints one JSON line; exit 0 pass, 1 fail. Standard library only
(plus this checkout's kvstrata); installs nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvstrata.clients import Client  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s")


def stream(base: str, model: str, prompt: str, max_tokens: int) -> tuple[float, str]:
    """Time to first token (s) and the whole text of a greedy streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}  # fmt: skip
    req = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    t0 = time.perf_counter()
    ttft, text = None, []
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            piece = json.loads(line[5:])["choices"][0]["text"]
            if ttft is None:
                ttft = time.perf_counter() - t0
            text.append(piece)
    return float(ttft or 0.0), "".join(text)


def hits(kv: Client) -> tuple[int, int]:
    dram = kv.stats().get("dram", {})
    return int(dram.get("chunks", 0)), int(dram.get("hits", 0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="local folder of a small model")
    ap.add_argument("--python", default=sys.executable, help="a python with vllm 0.33")
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--timeout", type=float, default=240)
    args = ap.parse_args()
    kv_port, http_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
           "VLLM_SERVER_DEV_MODE": "1"}  # fmt: skip
    tier = {"type": "KvstrataTier", "module_path": "kvstrata.clients.vllm",
            "url": f"redis://127.0.0.1:{kv_port}"}  # fmt: skip
    transfer = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
                                              "cpu_bytes_to_use": 2 << 30,
                                              "secondary_tiers": [tier]}}  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []
    out: dict[str, Any] = {"model": args.model}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            procs.append(subprocess.Popen(
                [args.python, "-m", "kvstrata", "serve", "--port", str(kv_port),
                 "--dram-capacity", "4GiB", "--nvme-capacity", "0", "--data-dir", tmp],
                env=env, stdout=subprocess.DEVNULL))  # fmt: skip
            procs.append(subprocess.Popen(
                [args.python, "-m", "vllm.entrypoints.cli.main", "serve", args.model,
                 "--port", str(http_port), "--max-model-len", "8192",
                 "--gpu-memory-utilization", "0.5", "--kv-transfer-config", json.dumps(transfer)],
                env=env))  # fmt: skip
            base = f"http://127.0.0.1:{http_port}"
            wait_http(f"{base}/health", procs[1], args.timeout)
            words = (f"item{i % 97} is number {i}." for i in range(args.prompt_tokens // 6))
            prompt = " ".join(words)
            with Client(port=kv_port) as kv:
                out["ttft_first_s"], first = stream(base, args.model, prompt, 16)
                deadline = time.monotonic() + 60
                while hits(kv)[0] == 0 and time.monotonic() < deadline:
                    time.sleep(0.2)  # the cascade CPU tier -> kvstrata runs after the request
                out["kvstrata_chunks"], before = hits(kv)
                for _ in range(100):  # fails while offload transfers are still in flight
                    req = urllib.request.Request(
                        f"{base}/reset_prefix_cache?reset_external=true", b"", method="POST")
                    with urllib.request.urlopen(req, timeout=30) as resp:
                        if json.loads(resp.read())["success"]:
                            break
                    time.sleep(0.2)
                out["ttft_second_s"], second = stream(base, args.model, prompt, 16)
                out["kvstrata_hits"] = hits(kv)[1] - before
            out["same_text"] = first == second
        finally:
            for p in reversed(procs):
                p.terminate()
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
    ok = out.get("kvstrata_chunks", 0) > 0 and out.get("kvstrata_hits", 0) > 0 and out["same_text"]
    out["speedup"] = round(out["ttft_first_s"] / max(out["ttft_second_s"], 1e-9), 2)
    out["passed"] = bool(ok)
    print(json.dumps(out))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
