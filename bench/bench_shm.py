"""Zero-copy writes and reads through shared memory on one host, n chunks per request: kvstrata
beside LMCache 0.5.6's multi-process (MP) server and memcpy, measured in one run.

Contenders, alternated round by round (the order rotates), medians of GB/s per chunk size
(1, 8 and 32 MiB; n = max(4, --request-mib / size) chunks per request, new chunks each round):

- kvstrata ``KV.RESERVE`` + copy + ``KV.COMMIT`` per chunk (2n round trips);
- kvstrata ``KV.MRESERVE`` of the n chunks + n copies + one ``KV.COMMIT`` (``reserve_chain``;
  2 round trips);
- kvstrata ``put_chain`` of the n chunks: streamed in parts of ``PIPE_BYTES`` (8 MiB), the
  next part's ``KV.MRESERVE`` sent before a part is filled and its ``KV.COMMIT`` after, so the
  server reserves and publishes while the client copies (issue 31,
  ``kvstrata.clients.chain_stream``; a request of one part is the batch put);
- the same, the chunks published as soon as they are copied, in groups of ~4 MiB
  (``WriteBatch.publish``: ``KV.COMMIT lease i…`` of each group; since issue 22 it waits for
  its reply, so that a refusal is heard at once);
- kvstrata ``KV.LEASE`` of the n chunks + n copies out + ``KV.RELEASE``;
- LMCache MP server, as its vLLM worker adapter drives it (``EngineDrivenContextShm``): put =
  ``prepare_store`` + n copies into its slots + ``commit_store``; get = ``prepare_retrieve`` +
  n copies out + ``commit_retrieve`` after an untimed ``lookup`` (its prefetch), see
  ``bench/_lmcache_mp.py``. Its copies are ``np.copyto`` of the same bytes, as kvstrata's
  (``--lmcache-torch-copy``: ``Tensor.copy_`` of the float16 tensors, which LMCache's venv runs
  at ~1–1.4 GB/s, see ``_lmcache_mp._copy``);
- memcpy: n ``np.copyto`` of the same sizes between touched buffers (the bound of every route).

kvstrata checksums each chunk (integrity, DESIGN.md); LMCache does not. Its puts fill the slots
with ``write``, which copies and checksums in one pass and sends the digest with the commit
(issue 31); "hashed" is the same batch put filled through array views, the server hashing each
slot at commit (the route before issue 31). Both shared regions are touched before the timed
rounds (kvstrata's: the rounds start once the server's background warm-up of its arena is over,
``INFO tiers`` ``dram_warming:0``). The MP server needs a few packages that LMCache's plugin venv
(``scripts/engines/lmcache.sh``) leaves out; an overlay venv adds them::

    python3 -m venv ~/.cache/kvstrata/venvs/lmcache-0.5.6-mp
    echo ~/.cache/kvstrata/venvs/lmcache-0.5.6/lib/python3.11/site-packages \\
        > ~/.cache/kvstrata/venvs/lmcache-0.5.6-mp/lib/python3.11/site-packages/lmcache.pth
    ~/.cache/kvstrata/venvs/lmcache-0.5.6-mp/bin/pip install blake3 httpx \\
        "opentelemetry-api<=1.40" opentelemetry-sdk "opentelemetry-exporter-prometheus<=0.61b0"

    PYTHONPATH=$PWD python3 bench/bench_shm.py \\
        --lmcache-python ~/.cache/kvstrata/venvs/lmcache-0.5.6-mp/bin/python [--rounds 7]

Without ``--lmcache-python`` only kvstrata and memcpy are measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _servers import free_port, kvstrata_server, wait_warmed

from kvstrata.clients import Client
from kvstrata.clients.leases import PublishGroups

NS = "bench-shm@f16@c256"
MiB = 1024 * 1024


class LMCacheMP:
    """bench/_lmcache_mp.py in LMCache's Python, one JSON line each way."""

    def __init__(self, python: str, l1_gb: float) -> None:
        worker = Path(__file__).resolve().parent / "_lmcache_mp.py"
        self.proc = subprocess.Popen([python, str(worker)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)  # fmt: skip
        self.shm = f"kvsbench-{uuid.uuid4().hex[:8]}"
        self.call("start", port=free_port(), shm=self.shm, l1_gb=l1_gb)

    def call(self, op: str, **kw: Any) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline() or '{"error": "worker exited"}')
        if "error" in reply:
            raise RuntimeError(f"LMCache MP {op}: {reply['error']}")
        return float(reply.get("s", 0.0))

    def close(self) -> None:
        try:
            self.call("stop")
        finally:
            self.proc.wait(30)
            Path("/dev/shm", f"lmcache_l1_pool_{self.shm}").unlink(missing_ok=True)


class KvstrataShm:
    """The kvstrata contenders for one chunk size: n sources, n destinations."""

    def __init__(self, kv: Client, mib: int, n: int) -> None:
        rng = np.random.default_rng(mib)
        self.kv, self.mib, self.n = kv, mib, n
        self.srcs = [rng.integers(0, 255, mib * MiB, dtype=np.uint8) for _ in range(n)]
        self.dsts = [np.ones(mib * MiB, np.uint8) for _ in range(n)]
        self.round = 0
        self.batch: list[bytes] = []
        self.stored: list[bytes] = []

    def _hashes(self, tag: bytes) -> list[bytes]:
        return [b"%s%d-%d-%d" % (tag, self.mib, self.round, i) for i in range(self.n)]

    def put_per_chunk(self) -> None:
        parent = None
        for h, src in zip(self._hashes(b"c"), self.srcs, strict=True):
            lease = self.kv.reserve(NS, h, parent, src.nbytes, tokens=256)
            lease.write(src)
            lease.commit()
            parent = h
        self.stored += self._hashes(b"c")

    def put_batched(self) -> None:
        self.batch = self._hashes(b"b")
        sizes = [s.nbytes for s in self.srcs]
        with self.kv.reserve_chain(NS, None, self.batch, sizes, tokens=256) as batch:
            for i in batch.reserved:
                batch.write(i, self.srcs[i])
        self.stored += self.batch

    def put_hashed(self) -> None:
        """The batch put as before issue 31: copies through array views, no digest sent, the
        server hashes each slot at commit."""
        hashes = self._hashes(b"s")
        sizes = [s.nbytes for s in self.srcs]
        with self.kv.reserve_chain(NS, None, hashes, sizes, tokens=256) as batch:
            for i in batch.reserved:
                np.copyto(batch.array(i), self.srcs[i])
        self.stored += hashes

    def put_chain(self) -> None:
        hashes = self._hashes(b"t")
        states = self.kv.put_chain(NS, hashes, self.srcs, tokens=256)
        assert states == ["stored"] * self.n, states
        self.stored += hashes

    def put_published(self) -> None:
        self.batch = self._hashes(b"p")
        sizes = [s.nbytes for s in self.srcs]
        with self.kv.reserve_chain(NS, None, self.batch, sizes, tokens=256) as batch:
            group = PublishGroups(batch.publish)
            for i in batch.reserved:
                batch.write(i, self.srcs[i])
                group.add(i, sizes[i])
        self.stored += self.batch

    def get_leased(self) -> None:
        lease = self.kv.lease(NS, self.batch, tier="dram")
        assert lease is not None and len(lease) == self.n
        for view, dst in zip(lease.arrays(), self.dsts, strict=True):
            np.copyto(dst, view)
        lease.release()

    def memcpy(self) -> None:
        for src, dst in zip(self.srcs, self.dsts, strict=True):
            np.copyto(dst, src)

    def next_round(self) -> None:
        """Untimed: check the last get, then free the arena for the next round's chunks."""
        assert np.array_equal(self.dsts[-1], self.srcs[-1]) or not self.batch
        with self.kv.pipeline() as p:
            for h in self.stored:
                p.delete(NS, h)
            p.execute()
        self.stored = []
        self.round += 1


def measure(
    mib: int, n: int, kv: Client, lmc: LMCacheMP | None, rounds: int, torch_copy: bool
) -> dict[str, float]:
    k = KvstrataShm(kv, mib, n)
    steps: dict[str, Callable[[], object]] = {
        "chunk put": k.put_per_chunk, "batch put": k.put_batched, "chain put": k.put_chain,
        "publish put": k.put_published,
        "hashed put": k.put_hashed, "lease get": k.get_leased, "memcpy": k.memcpy,
    }  # fmt: skip
    if lmc is not None:
        lmc.call("setup", mib=mib, n=n, torch_copy=torch_copy)
        steps["lmc put"] = lambda: lmc.call("put", mib=mib)
        steps["lmc get"] = lambda: lmc.call("get", mib=mib)
    order = list(steps)
    times: dict[str, list[float]] = {name: [] for name in order}
    for r in range(rounds + 1):  # round 0 warms up
        rot = order[r % len(order) :] + order[: r % len(order)]
        if "lease get" in rot and rot.index("lease get") < rot.index("publish put"):
            rot.remove("lease get")
            rot.insert(rot.index("publish put") + 1, "lease get")
        if "lmc get" in rot and rot.index("lmc get") < rot.index("lmc put"):
            rot.remove("lmc get")
            rot.insert(rot.index("lmc put") + 1, "lmc get")
        for name in rot:
            t = time.perf_counter()
            inner = steps[name]()
            took = inner if name.startswith("lmc") else time.perf_counter() - t
            if r:
                times[name].append(float(took))  # type: ignore[arg-type]
        k.next_round()
    total = n * mib * MiB
    out = {name: total / statistics.median(ts) / 1e9 for name, ts in times.items()}
    pairs = (("batch put", "lmc put"), ("publish put", "lmc put"), ("lease get", "lmc get"),
             ("publish put", "chunk put"), ("batch put", "memcpy"), ("publish put", "memcpy"),
             ("chain put", "memcpy"), ("chain put", "lmc put"),
             ("hashed put", "memcpy"), ("lease get", "memcpy"))  # fmt: skip
    for a, b in pairs:
        if b in times:  # a busy machine slows a whole round: the ratio within rounds is steadier
            out[f"{a}/{b}"] = statistics.median(
                tb / ta for ta, tb in zip(times[a], times[b], strict=True)
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lmcache-python", help="a Python that imports LMCache's MP server")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--sizes", default="1,8,32", help="chunk sizes in MiB")
    ap.add_argument("--request-mib", type=int, default=64, help="MiB per request (n chunks)")
    ap.add_argument("--lmcache-torch-copy", action="store_true",
                    help="LMCache's copies with Tensor.copy_ of float16 (slow in its venv)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    plan = [(mib, max(4, args.request_mib // mib)) for mib in sizes]
    l1_gb = sum((args.rounds + 1) * mib * n for mib, n in plan) / 1024 + 0.5
    lmc = LMCacheMP(args.lmcache_python, l1_gb) if args.lmcache_python else None
    rows = []
    try:
        flags = ("--dram-capacity", "1GiB", "--nvme-capacity", "0")
        with kvstrata_server(*flags) as srv, Client(port=srv.port) as kv:
            wait_warmed(kv)  # the arena's background warm-up would compete with the rounds
            for mib, n in plan:
                g = measure(mib, n, kv, lmc, args.rounds, args.lmcache_torch_copy)
                rows.append((mib, n, g))
    finally:
        if lmc is not None:
            lmc.close()
    print("Shared-memory put (kv chunk: RESERVE+COMMIT per chunk; kv batch: MRESERVE + one COMMIT;")
    print("kv publish: MRESERVE + COMMIT of each chunk once copied, each reply awaited) and")
    print("get, n chunks per request (GB/s, medians of alternated rounds;")
    print("ratios: medians of the per-round ratios)")
    head = (f"{'MiB':>4} {'n':>3} {'memcpy':>7} {'kv chunk':>9} {'kv batch':>9} {'kv publish':>11}"
            f" {'LMCache':>8} {'batch/LMC':>10} {'publ/LMC':>9} {'publ/chunk':>11}"
            f" {'kv lease get':>13} {'LMCache get':>12} {'lease/LMC':>10}")  # fmt: skip
    print(head)
    nan = float("nan")
    for mib, n, g in rows:
        print(f"{mib:>4} {n:>3} {g['memcpy']:>7.2f} {g['chunk put']:>9.2f}"
              f" {g['batch put']:>9.2f} {g['publish put']:>11.2f} {g.get('lmc put', nan):>8.2f}"
              f" {g.get('batch put/lmc put', nan):>10.2f} {g.get('publish put/lmc put', nan):>9.2f}"
              f" {g['publish put/chunk put']:>11.2f} {g['lease get']:>13.2f}"
              f" {g.get('lmc get', nan):>12.2f}"
              f" {g.get('lease get/lmc get', nan):>10.2f}")  # fmt: skip
    print()
    print("Against memcpy (medians of per-round ratios; 'hashed': the batch put without a client")
    print("digest, the server hashing each slot at commit, as before issue 31)")
    print(f"{'MiB':>4} {'batch/memcpy':>13} {'chain/memcpy':>13} {'chain/LMC':>10}"
          f" {'publish/memcpy':>15} {'hashed/memcpy':>14} {'lease get/memcpy':>17}")  # fmt: skip
    for mib, _, g in rows:
        print(f"{mib:>4} {g['batch put/memcpy']:>13.2f} {g['chain put/memcpy']:>13.2f}"
              f" {g.get('chain put/lmc put', nan):>10.2f}"
              f" {g['publish put/memcpy']:>15.2f}"
              f" {g['hashed put/memcpy']:>14.2f} {g['lease get/memcpy']:>17.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
