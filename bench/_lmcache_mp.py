"""LMCache 0.5.6's multi-process (MP) server driven as a vLLM worker drives it, for bench_shm.py.

Runs in a Python that can import LMCache's MP server (see bench_shm.py). Started by bench_shm.py,
it answers one JSON line per JSON line on stdin:

- ``{"op": "start", "port": P, "shm": NAME, "l1_gb": G}``: start ``python -m
  lmcache.v1.multiprocess.server`` (engine-driven transfers through the shared-memory pool
  ``NAME``, LRU) and wait until it listens;
- ``{"op": "setup", "mib": M, "n": N, "torch_copy": false}``: register a worker instance whose
  chunk (256 tokens, fp16, ``[2, layers, 256, 1024]``) is M MiB, open its shared-memory context
  (``EngineDrivenContextShm``, what LMCache's vLLM worker adapter uses), fault in its mapping
  of the whole pool (kvstrata's arena is touched at start and its client's mapping is warm after
  the first round, so neither pays page faults in the timed rounds) and fill N source chunks;
- ``{"op": "put", "mib": M}``: store N new chunks in one request: ``prepare_store`` (server
  hashes the tokens and reserves N slots), one copy per chunk into its slot, ``commit_store``;
- ``{"op": "get", "mib": M}``: load the N chunks of the last put: ``lookup`` + waiting for its
  prefetch (untimed, like kvstrata's KV.MATCH), then, timed, ``prepare_retrieve`` (slots),
  one copy per chunk out of its slot, ``commit_retrieve``;
- ``{"op": "stop"}``.

Each reply is ``{"s": seconds}`` (or ``{"ok": true}``, or ``{"error": "..."}``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc
from lmcache.v1.multiprocess.custom_types import (
    IPCCacheServerKey,
    RegisterEngineDrivenContextPayload,
)
from lmcache.v1.multiprocess.transfer_context.base import (
    EngineDrivenContextMetadata,
    create_engine_driven_context,
)
from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

TOKENS = 256
HIDDEN = 1024  # 8 KV heads x 128
TIMEOUT = 60.0


@dataclass
class Size:
    model: str
    instance: int
    n: int
    ctx: Any
    srcs: list[torch.Tensor]
    dsts: list[torch.Tensor]
    torch_copy: bool  # Tensor.copy_ of float16 (see _copy) instead of np.copyto
    last: tuple[int, ...] = ()


MADV_POPULATE_WRITE = 23  # Linux 5.14+; Python 3.11's mmap does not name it


def _populate(ctx: Any, first: bool) -> None:
    """Fault in this context's mapping of the pool, writable, without changing a byte: the
    copies into slots then cost what they cost in a long-running worker (kvstrata's client
    keeps one mapping of its arena, whose slots the bench reuses). Without the madvise, the
    first context's mapping is touched by writing zeros (no chunk is stored yet)."""
    try:
        ctx._shm._mmap.madvise(MADV_POPULATE_WRITE)
    except (AttributeError, OSError, ValueError):
        if first:
            np.frombuffer(ctx._shm_buffer, np.uint8)[:] = 0


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """One memcpy, as kvstrata's side does (np.copyto). In LMCache's venv ``Tensor.copy_`` of
    float16 tensors runs at ~1–1.4 GB/s (uint8 and float32 at memory speed; the same libtorch
    under ``python -S`` copies float16 at memory speed too), a quirk of that environment, not a
    cost of LMCache's protocol: the bytes are copied with numpy unless ``torch_copy``."""
    np.copyto(dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy())


class Driver:
    def __init__(self) -> None:
        self.server: subprocess.Popen[bytes] | None = None
        self.client: Any = None
        self.sizes: dict[int, Size] = {}
        self.touched = False

    def start(self, port: int, shm: str, l1_gb: float) -> None:
        argv = [sys.executable, "-m", "lmcache.v1.multiprocess.server", "--port", str(port),
                "--l1-size-gb", str(l1_gb), "--eviction-policy", "LRU", "--shm-name", shm,
                "--supported-transfer-mode", "engine_driven", "--chunk-size", str(TOKENS),
                "--disable-observability"]  # fmt: skip
        # its per-request INFO lines ("Retrieved N tokens in …") are not part of the cost measured
        env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "LMCACHE_LOG_LEVEL": "WARNING"}
        self.server = subprocess.Popen(argv, stdout=sys.stderr, stderr=sys.stderr, env=env)
        deadline = time.monotonic() + 120
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if self.server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the LMCache MP server did not start") from None
                time.sleep(0.2)
        self.client = RequestClientFactory.create(f"tcp://127.0.0.1:{port}")

    def setup(self, mib: int, n: int, torch_copy: bool = False) -> None:
        layers = mib  # 2 x layers x 256 x 1024 x 2 bytes = layers MiB
        shape = torch.Size([2, layers, TOKENS, HIDDEN])
        model, instance = f"bench{mib}", 4000 + mib
        payload = RegisterEngineDrivenContextPayload(
            instance_id=instance, model_name=model, world_size=1, block_size=16,
            num_layers=layers, hidden_dim_size=HIDDEN, dtype_str="float16", use_mla=False,
            num_physical_slots=TOKENS,
        )  # fmt: skip
        resp = self.client.register_kv_cache_engine_driven_context(payload).result(TIMEOUT)
        meta = EngineDrivenContextMetadata(
            MemoryLayoutDesc(shapes=[shape], dtypes=[torch.float16]), 16, False
        )
        ctx = create_engine_driven_context(meta, self.client, TIMEOUT, resp.shm_name,
                                           resp.pool_size)  # fmt: skip
        if type(ctx).__name__ != "EngineDrivenContextShm":
            raise RuntimeError(f"LMCache fell back to {type(ctx).__name__}, not shared memory")
        _populate(ctx, first=not self.touched)
        self.touched = True
        srcs = [torch.randn(shape).half() for _ in range(n)]
        dsts = [torch.empty(shape, dtype=torch.float16).fill_(1) for _ in range(n)]
        self.sizes[mib] = Size(model, instance, n, ctx, srcs, dsts, torch_copy)

    def _key(self, s: Size, tokens: tuple[int, ...], readers: int = 0) -> Any:
        return IPCCacheServerKey(s.model, 1, 0, tokens, 0, len(tokens),
                                 request_id=str(uuid.uuid4()), num_kv_readers=readers)  # fmt: skip

    def put(self, mib: int) -> float:
        s = self.sizes[mib]
        tokens = tuple(int(t) for t in np.random.randint(0, 1 << 30, s.n * TOKENS))
        key = self._key(s, tokens)
        t = time.perf_counter()
        got = s.ctx.prepare_store(key, s.instance)
        if got is None or len(got[0]) != s.n:
            raise RuntimeError(f"prepare_store gave {got and len(got[0])} slots, not {s.n}")
        for slot, src in zip(got[0], s.srcs, strict=True):
            slot.copy_(src) if s.torch_copy else _copy(slot, src)
        if not s.ctx.commit_store(key, s.instance, got[0]):
            raise RuntimeError("commit_store failed")
        took = time.perf_counter() - t
        s.last = tokens
        return took

    def get(self, mib: int) -> float:
        s = self.sizes[mib]
        key = self._key(s, s.last, readers=1)
        self.client.lookup(key, 1).result(TIMEOUT)
        found = self.client.wait_prefetch_status(key.request_id, TIMEOUT).result(TIMEOUT)
        if found != s.n:
            raise RuntimeError(f"lookup found {found} of {s.n} chunks")
        t = time.perf_counter()
        slots = s.ctx.prepare_retrieve(key, s.instance)
        if slots is None or len(slots) != s.n:
            raise RuntimeError("prepare_retrieve missed")
        for slot, dst in zip(slots, s.dsts, strict=True):
            dst.copy_(slot) if s.torch_copy else _copy(dst, slot)
        s.ctx.commit_retrieve(key, s.instance)
        took = time.perf_counter() - t
        if not torch.equal(s.dsts[-1], s.srcs[-1]):
            raise RuntimeError("LMCache returned other bytes")
        self.client.end_session(key.request_id).result(TIMEOUT)
        return took

    def stop(self) -> None:
        for s in self.sizes.values():
            s.ctx.close()
        if self.server is not None:
            self.server.terminate()
            self.server.wait(30)


def main() -> None:
    driver = Driver()
    for line in sys.stdin:
        req = json.loads(line)
        op = req.pop("op")
        try:
            if op == "stop":
                driver.stop()
                print(json.dumps({"ok": True}), flush=True)
                return
            result = getattr(driver, op)(**req)
            reply = {"ok": True} if result is None else {"s": result}
        except Exception as exc:  # reported to bench_shm.py, which stops
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
