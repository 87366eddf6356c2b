"""Probes of the CUDA paths that unit tests cannot show, run by ``scripts/gpu-check.sh``.

    gpu_probe.py paths [--dry-run]   both runtime paths, each across two processes
    gpu_probe.py pin [--gib N] [--dry-run]   cudaHostRegister seconds per GiB

``paths`` runs the GPU pool's two runtime bindings, each in its own server process, with a
client process of the matching kind: ``cudart`` (ctypes on the libcudart torch loaded) served
to a torch client (``handle_tensor``), and ``cupy`` (``cupy.cuda.runtime``, torch never
imported) served to a CuPy-only client (``handle_cupy``). Each process prints the libcudart
files it mapped (``/proc/self/maps``): one per process is right, two mean a second runtime was
loaded beside the engine's. The client checks the bytes (xxh3-128) and closes its mapping.

``pin`` times ``cudaHostRegister`` of an already-touched host buffer (the DRAM arena's pinning
at start-up), and its unregister, in seconds per GiB.

Every probe prints one ``probe <name>: ok|FAILED|skipped …`` line per check and exits 1 if one
failed. ``--dry-run`` (no CUDA needed) prints the plan and this process's mapped libcudart
files, so the script itself is exercised on CPU machines.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstrata.cudart import mapped_cudart

GiB = 1024**3
CHUNK = 8 * 1024 * 1024
COMBOS = (("cudart", "torch"), ("cupy", "cupy"))


def report(name: str, status: str, detail: str) -> None:
    print(f"probe {name}: {status} {detail}", flush=True)


def server_half(backend: str) -> int:
    """Allocate a pool with ``backend``, fill a chunk, print the spec, wait for stdin."""
    import numpy as np

    from kvstrata.tiers.checksum import checksum
    from kvstrata.tiers.gpu_memory import CudaMemory
    from kvstrata.tiers.gpu_runtime import CudartRuntime, CupyRuntime, find_cudart

    if backend == "cupy":
        runtime: Any = CupyRuntime()
    else:
        import torch  # noqa: F401  # loads the libcudart this process then uses

        lib = find_cudart(search=False)
        assert lib is not None, "torch mapped no libcudart"
        runtime = CudartRuntime(lib)
    mem = CudaMemory(runtime, 0, 4 * CHUNK)
    data = np.random.default_rng(7).integers(0, 256, CHUNK, dtype=np.uint8)
    mem.to_device(CHUNK, data.data)
    spec = {
        "region": {"name": "gpu0", "kind": "cuda", "size": mem.size,
                   "path": mem.ipc_handle().hex(), "device": 0, "pci_bus_id": mem.pci_bus_id},
        "handle": {"region": "gpu0", "offset": CHUNK, "length": CHUNK},
        "checksum": checksum(data.data).hex(),
        "maps": mapped_cudart(),
        "backend": mem.backend,
    }  # fmt: skip
    print(json.dumps(spec), flush=True)
    sys.stdin.readline()  # the client is done: only now may the pool go
    mem.close()
    return 0


def client_half(kind: str, spec_json: str) -> int:
    from kvstrata.clients import handles
    from kvstrata.clients.cuda_ipc import CupyIpc
    from kvstrata.clients.results import Handle, RegionInfo
    from kvstrata.tiers.checksum import checksum

    spec = json.loads(spec_json)
    region, handle = RegionInfo(**spec["region"]), Handle(**spec["handle"])
    if kind == "cupy":
        import cupy

        handles._ipc_runtime = lambda: CupyIpc(cupy)  # the CuPy binding, torch never imported
        data = cupy.asnumpy(handles.handle_cupy(region, handle)).tobytes()
    else:
        data = handles.handle_tensor(region, handle).cpu().numpy().tobytes()
    via = handles._cuda[region.name].runtime.name
    ok = checksum(data).hex() == spec["checksum"]
    closed_before = handles.close_all()
    print(json.dumps({"ok": ok, "maps": mapped_cudart(), "via": via, "torch": "torch" in
                      sys.modules, "busy_at_close": closed_before}), flush=True)  # fmt: skip
    return 0 if ok else 1


def _run_combo(server: str, client: str) -> bool:
    name = f"paths server={server} client={client}"
    me = [sys.executable, __file__]
    srv = subprocess.Popen([*me, "_server", server], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert srv.stdout is not None and srv.stdin is not None
        line = srv.stdout.readline()
        if not line:
            report(name, "FAILED", f"server half: {srv.communicate(timeout=30)[1][-2000:]}")
            return False
        spec = json.loads(line)
        cli = subprocess.run([*me, "_client", client, line], capture_output=True, text=True,
                             timeout=120)  # fmt: skip
        srv.stdin.write("done\n")
        srv.stdin.flush()
        out = cli.stdout.strip().splitlines()
        if cli.returncode != 0 or not out:
            report(name, "FAILED", f"client half: {cli.stderr[-2000:]}")
            return False
        res = json.loads(out[-1])
        ok = bool(res["ok"]) and len(set(res["maps"])) <= 1 and len(set(spec["maps"])) <= 1
        report(name, "ok" if ok else "FAILED",
               f"bytes {'right' if res['ok'] else 'WRONG'}; server backend {spec['backend']} "
               f"bus {spec['region']['pci_bus_id']} maps {spec['maps']}; client via "
               f"{res['via']} (torch imported: {res['torch']}) maps {res['maps']}")  # fmt: skip
        return ok
    finally:
        if srv.poll() is None:
            try:
                srv.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                srv.kill()


def probe_paths(dry_run: bool) -> int:
    if dry_run:
        for server, client in COMBOS:
            report(f"paths server={server} client={client}", "skipped", "(dry run)")
        report("paths maps", "ok", f"this process maps {mapped_cudart()} (dry run)")
        return 0
    failed = 0
    for server, client in COMBOS:
        try:
            failed += not _run_combo(server, client)
        except Exception as exc:  # report and go on to the next combination
            report(f"paths server={server} client={client}", "FAILED", repr(exc))
            failed += 1
    return 1 if failed else 0


def probe_pin(gib: float, dry_run: bool) -> int:
    import numpy as np

    from kvstrata.tiers._cuda import cuda_unavailable_reason, host_register, host_unregister

    nbytes = int((64 * 1024 * 1024) if dry_run else gib * GiB)
    why = cuda_unavailable_reason()
    if why is not None:
        status = "skipped" if dry_run else "FAILED"
        report("pin", status, f"{why} ({'dry run' if dry_run else 'needs CUDA'})")
        return 0 if dry_run else 1
    buf = np.ones(nbytes, dtype=np.uint8)  # pages touched: only the pinning is timed
    ptr = int(buf.ctypes.data)
    t0 = time.perf_counter()
    err = host_register(ptr, nbytes)
    t1 = time.perf_counter()
    if err is not None:
        report("pin", "FAILED", err)
        return 1
    host_unregister(ptr)
    t2 = time.perf_counter()
    per = (t1 - t0) / (nbytes / GiB)
    report("pin", "ok", f"{nbytes / GiB:.2f} GiB pinned in {t1 - t0:.3f} s = {per:.3f} s/GiB "
           f"(unpinned in {t2 - t1:.3f} s)")  # fmt: skip
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["_server"]:
        return server_half(argv[1])
    if argv[:1] == ["_client"]:
        return client_half(argv[1], argv[2])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("probe", choices=["paths", "pin"])
    p.add_argument("--gib", type=float, default=4.0, help="pin: GiB to register (4)")
    p.add_argument("--dry-run", action="store_true", help="no CUDA: print the plan only")
    args = p.parse_args(argv)
    if args.probe == "paths":
        return probe_paths(args.dry_run)
    return probe_pin(args.gib, args.dry_run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
