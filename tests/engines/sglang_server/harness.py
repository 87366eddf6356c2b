"""Launching SGLang 0.5.23's real server on CPU with HiCache and kvstrata as its L3, for the
server test and the serving benchmark.

Each server is ``python -m sglang.launch_server`` in its own process group, started from a
scratch directory (a ``kvstrata/`` folder in the working directory would shadow the checkout as
a namespace package), with the checkout and the test-only shims (``shims/``: a stand-in
``sgl_kernel`` and a CPU host-pool plugin) on PYTHONPATH. Every wait polls a condition (the
health endpoint, a process exit, kvstrata's key count) against a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib import error, request

ROOT = Path(__file__).resolve().parents[3]
SHIMS = Path(__file__).resolve().parent / "shims"

#: Tokens per HiCache page (one kvstrata chunk).
PAGE = 64

#: Seconds a server may take to come up on a loaded 2-core machine.
START_TIMEOUT = float(os.environ.get("KVSTRATA_SGLANG_START_TIMEOUT", "300"))


def storage_extra(url: str, *, interface_v1: bool = True, **extra: Any) -> dict[str, Any]:
    """``--hicache-storage-backend-extra-config`` for the kvstrata backend."""
    return {
        "backend_name": "kvstrata",
        "module_path": "kvstrata.clients.sglang",
        "class_name": "KvstrataHiCacheStorage",
        "url": url,
        "interface_v1": int(interface_v1),
        **extra,
    }


def server_argv(
    model: Path,
    port: int,
    *,
    kv_url: str | None,
    max_total_tokens: int = 4096,
    hicache_ratio: float = 2.0,
    layout: str = "page_first",
    interface_v1: bool = True,
) -> list[str]:
    """The exact flags that run SGLang 0.5.23 on CPU with HiCache (and kvstrata when
    ``kv_url`` is given)."""
    argv = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(model),
        "--device", "cpu",
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32",
        "--attention-backend", "torch_native",
        "--sampling-backend", "pytorch",
        "--page-size", str(PAGE),
        "--max-total-tokens", str(max_total_tokens),
        "--mem-fraction-static", "0.3",
        "--max-running-requests", "4",
        "--chunked-prefill-size", "-1",
        "--disable-cuda-graph",
        "--disable-overlap-schedule",
        "--skip-server-warmup",
        "--enable-hierarchical-cache",
        "--hicache-ratio", str(hicache_ratio),
        "--hicache-mem-layout", layout,
        "--hicache-write-policy", "write_through",
        "--log-level", "info",
    ]  # fmt: skip
    if kv_url is not None:
        extra = storage_extra(kv_url, interface_v1=interface_v1)
        argv += [
            "--hicache-storage-backend", "dynamic",
            "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-storage-backend-extra-config", json.dumps(extra),
        ]  # fmt: skip
    return argv


def server_env() -> dict[str, str]:
    path = os.pathsep.join([str(ROOT), str(SHIMS), os.environ.get("PYTHONPATH", "")])
    return {
        **os.environ,
        "PYTHONPATH": path.rstrip(os.pathsep),
        "SGLANG_USE_CPU_ENGINE": "1",
        "SGLANG_PLUGINS": "kvstrata_cpu_hicache",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def wait_until(cond: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    if not cond():
        raise TimeoutError(f"gave up after {timeout:.0f}s waiting for {what}")


@dataclass
class SGLangServer:
    """One running ``sglang.launch_server``; ``log`` holds its output."""

    port: int
    log: Path
    proc: subprocess.Popen[bytes]
    argv: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"SGLang exited ({self.proc.returncode}):\n{self.log_text()[-6000:]}"
            )
        try:
            with request.urlopen(f"{self.url}/health", timeout=5) as r:
                return bool(r.status == 200)
        except (error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float = START_TIMEOUT) -> SGLangServer:
        wait_until(self.healthy, f"SGLang on port {self.port}", timeout)
        return self

    def post(self, path: str, body: dict[str, Any] | None = None, timeout: float = 300) -> Any:
        data = json.dumps(body or {}).encode()
        req = request.Request(f"{self.url}{path}", data=data,
                              headers={"Content-Type": "application/json"})  # fmt: skip
        with request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode(errors="replace")

    def generate(self, text: str, max_new_tokens: int = 8) -> dict[str, Any]:
        """Greedy generation with logprobs; SGLang's /generate reply."""
        body = {
            "text": text,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                "ignore_eos": True},
            "return_logprob": True,
        }  # fmt: skip
        return dict(self.post("/generate", body))

    def flush_cache(self) -> None:
        """Empty the device and host pools (SGLang's /flush_cache), retried while requests
        are still in flight (SGLang refuses the flush then)."""

        def flushed() -> bool:
            try:
                self.post("/flush_cache", timeout=30)
            except error.HTTPError:
                return False
            return True

        wait_until(flushed, "SGLang to flush its cache", 60)

    def stop(self, timeout: float = 30) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout)


def launch(model: Path, port: int, workdir: Path, *, name: str, **kwargs: Any) -> SGLangServer:
    """Start a server (not waiting for it: start several, then ``wait_ready`` each)."""
    run_dir = workdir / name
    run_dir.mkdir(parents=True, exist_ok=True)
    log = workdir / f"{name}.log"
    argv = server_argv(model, port, **kwargs)
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, cwd=run_dir, env=server_env(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    return SGLangServer(port, log, proc, argv)


@dataclass(frozen=True)
class Reply:
    """What the tests compare between two answers to one prompt."""

    text: str
    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    cached_tokens: int
    prompt_tokens: int


def reply(raw: dict[str, Any]) -> Reply:
    meta = raw["meta_info"]
    entries = meta["output_token_logprobs"]
    return Reply(
        text=raw["text"],
        ids=tuple(int(e[1]) for e in entries),
        logprobs=tuple(float(e[0]) for e in entries),
        cached_tokens=int(meta.get("cached_tokens", 0)),
        prompt_tokens=int(meta["prompt_tokens"]),
    )
