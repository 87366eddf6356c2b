"""Bounded concurrent stress of fenced leases (issues 10 and 22): every byte read through a
lease is the leased chunk's, and the memory held for holders returns when they go away.

Six client processes run for a few seconds against one server whose 4 MiB arena is under
constant pressure (chunks of 16–128 KiB demoted to NVMe and evicted). Each one puts chunks,
leases chunks of any client with TTLs of 50–300 ms and checks the views at once and again
after the lease expired (while other clients delete and put), releases some leases and never
others, deletes chunks, and reserves slots that it fills either at once (committed) or late,
once the lease has probably expired. It also reserves batches (``reserve_chain``): some filled,
published early chunk by chunk and committed; others with a short TTL whose first slots are
published at once and the rest filled late, then published (expiry mid-fill), the expired batch
aborted or left fenced until the process ends. Every lease id it holds is also tried from a
second connection (KV.COMMIT with and without index, KV.ABORT, KV.RELEASE), which must be
refused. Two of the clients are killed with SIGKILL half-way, holding leases and fences.

Every chunk's content is its 8-byte key repeated, so a foreign byte is always seen, except the
chunks written late, whose keys name a late owner (50 + the worker) and whose content is 0xEE:
whether a late write is refused is the server's decision (its TTL starts when it answers, after
any wait for room, so a client's clock cannot tell), and either outcome is checked by bytes: a
refused late write must never show up in another chunk, an accepted one stores its own 0xEE.
At the end: zero wrong bytes in every report, some late writes refused, every stored chunk
intact, and no lease, fence or reservation left: the arena holds exactly the chunks it lists.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable

import redis

from tests.conftest import RunningServer
from tests.fakes import wait_for

NS = "stress@u8@c16"
WORKERS = 6
KILLED = 2
SECONDS = 6.0

WORKER = textwrap.dedent(
    """
    import json, random, sys, time
    import numpy as np
    from kvstrata.clients import Client, LeaseError, OutOfMemoryError
    from kvstrata.protocol.errors import BusyError
    try:
        from kvstrata.protocol.errors import LeaseLimitError
    except ImportError:  # a server without lease limits (the test runs against old code too)
        class LeaseLimitError(Exception):
            pass

    port, ns, me, seconds = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    rng = random.Random(me)
    SIZES = (16384, 65536, 131072)
    OWNERS = [*range(6), *range(50, 56)]  # 50 + w: chunks worker w wrote late (0xEE)
    stats = {"checked": 0, "wrong": 0, "late_commits": 0, "late_refused": 0, "ops": 0,
             "limits": 0, "oom": 0, "expired": 0, "batches": 0, "published": 0,
             "batch_late_refused": 0, "batch_late_commits": 0, "foreign_tries": 0,
             "foreign_ok": 0}

    def key(w, n):
        return b"%02d%06d" % (w, n)

    def size_of(h):
        return SIZES[int(h[2:]) % 3]

    def expected(h):
        if int(h[:2]) >= 50:
            return np.full(size_of(h), 0xEE, dtype=np.uint8)
        return np.tile(np.frombuffer(h, dtype=np.uint8), size_of(h) // 8)

    def check(arr, h):
        want = expected(h)
        stats["checked"] += arr.size
        stats["wrong"] += int((arr != want).sum()) if arr.size == want.size else arr.size

    def report():
        print(json.dumps(stats), flush=True)

    kv = Client(port=port, max_connections=1)
    spy = Client(port=port, max_connections=1)  # another connection: may end none of kv's

    def try_foreign(lease_id):
        for verb in (("KV.COMMIT", 0), ("KV.COMMIT",), ("KV.ABORT",), ("KV.RELEASE",)):
            try_one(verb[0], lease_id, *verb[1:])

    def try_one(*args):
        stats["foreign_tries"] += 1
        try:
            spy.execute(*args)
            stats["foreign_ok"] += 1
        except LeaseError as exc:
            if "no such lease" not in str(exc):
                stats["foreign_ok"] += 1  # told the id exists (expired, wrong kind...)

    def fill_batch(batch, indexes, late):
        for i in indexes:
            batch.array(i)[:] = 0xEE if late else expected(batch.hashes[i])

    held = []  # (lease, hashes, arrays, expired_at)
    writes = []  # (write lease, expired_at)
    late_batches = []  # (batch, late indexes, due)
    fenced = []  # expired batches not aborted: fenced until the end (or a LEASELIMIT)
    mine = 0
    end = time.monotonic() + seconds
    last = time.monotonic()
    while time.monotonic() < end:
        stats["ops"] += 1
        now = time.monotonic()
        roll = rng.random()
        try:
            if roll < 0.30:
                h = key(me, mine)
                mine += 1
                kv.put(ns, h, None, expected(h))
            elif roll < 0.55:
                hs = [key(rng.choice(OWNERS), rng.randrange(max(mine, 1) + 20)) for _ in range(2)]
                ttl = rng.randrange(50, 300)
                lease = kv.lease(ns, hs, ttl_ms=ttl)
                if lease is not None:
                    arrays = lease.arrays()
                    for arr, h in zip(arrays, lease.hashes):
                        check(arr, h)
                    if rng.random() < 0.2:
                        try_foreign(lease.lease_id)
                    if rng.random() < 0.5:
                        lease.release()
                    else:
                        held.append((lease, arrays, now + ttl / 1000 + 0.25))
            elif roll < 0.63:
                kv.delete(ns, key(rng.choice(OWNERS), rng.randrange(max(mine, 1) + 20)))
            elif roll < 0.71:
                late = rng.random() < 0.5
                h = key(50 + me if late else me, mine)
                mine += 1
                w = kv.reserve(ns, h, None, size_of(h), ttl_ms=rng.randrange(50, 200))
                if rng.random() < 0.3:
                    try_foreign(w.lease_id)
                if not late:
                    w.array()[:] = expected(h)
                    w.commit()
                else:
                    writes.append((w, now + 0.45))
            elif roll < 0.80:
                n = rng.randrange(2, 5)
                short = rng.random() < 0.5
                early = rng.randrange(1, n) if short else n
                hs = [key(me if i < early else 50 + me, mine + i) for i in range(n)]
                mine += n
                ttl = rng.randrange(50, 150) if short else 5000
                batch = kv.reserve_chain(ns, None, hs, [size_of(h) for h in hs], ttl_ms=ttl)
                stats["batches"] += 1
                if rng.random() < 0.3:
                    try_foreign(batch.lease_id)
                try:
                    for i in range(early):
                        fill_batch(batch, [i], False)
                        if i < n - 1 or short:
                            batch.publish(i)  # early publish (a short lease may be over)
                            stats["published"] += 1
                except LeaseError:
                    stats["expired"] += 1
                    batch.abort()
                    continue
                if short:
                    late_batches.append((batch, list(range(early, n)), now + 0.3))
                else:
                    batch.commit()
            else:
                for item in [x for x in held if x[2] <= now]:
                    lease, arrays, _ = item
                    for arr, h in zip(arrays, lease.hashes):
                        check(arr, h)  # expired: fenced, still this chunk's bytes
                    held.remove(item)
                    if rng.random() < 0.7:
                        try:
                            lease.release()
                        except LeaseError:
                            pass
                for item in [x for x in writes if x[1] <= now]:
                    w, _ = item
                    writes.remove(item)
                    w.array()[:] = 0xEE  # the late writer
                    try:
                        w.commit()
                        stats["late_commits"] += 1
                    except LeaseError:
                        stats["late_refused"] += 1
                for item in [x for x in late_batches if x[2] <= now]:
                    batch, late, _ = item
                    late_batches.remove(item)
                    fill_batch(batch, late, True)  # mid-fill: the lease has likely expired
                    if rng.random() < 0.3:
                        try_foreign(batch.lease_id)
                    try:
                        batch.publish(*late)
                        stats["batch_late_commits"] += 1
                        batch.commit()
                    except LeaseError:
                        stats["batch_late_refused"] += 1
                        if rng.random() < 0.7:
                            batch.abort()
                        else:
                            fenced.append(batch)
        except LeaseLimitError:
            stats["limits"] += 1
            for lease, arrays, _ in held:
                for arr, h in zip(arrays, lease.hashes):
                    check(arr, h)
                try:
                    lease.release()
                except LeaseError:
                    pass
            held.clear()
            for batch in fenced:
                batch.abort()
            fenced.clear()
        except (OutOfMemoryError, BusyError):
            stats["oom"] += 1
        except LeaseError:  # a lease this busy machine let expire before its release/commit
            stats["expired"] += 1
        if time.monotonic() - last > 0.5:
            last = time.monotonic()
            report()
    for lease, arrays, _ in held:
        for arr, h in zip(arrays, lease.hashes):
            check(arr, h)
    report()
    """
)


def last_report(out: str) -> dict[str, int]:
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"a client reported nothing:\n{out}"
    return json.loads(lines[-1])


def test_concurrent_leases_under_pressure_never_show_foreign_bytes(
    make_process_server: Callable[..., RunningServer],
) -> None:
    srv = make_process_server(dram_capacity="4MiB", nvme_capacity="64MiB",
                              lease_fence_max="1MiB")  # fmt: skip
    argv = [sys.executable, "-c", WORKER, str(srv.port), NS]
    out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    procs = [subprocess.Popen([*argv, str(i), str(SECONDS)], **out) for i in range(WORKERS)]
    early = ["" for _ in procs]
    for i, p in enumerate(procs[:KILLED]):  # killed once they have worked a while
        assert p.stdout is not None
        for line in p.stdout:
            early[i] += line
            if line.startswith("{") and json.loads(line)["ops"] > 50:
                break
        os.kill(p.pid, signal.SIGKILL)
    reports = []
    for i, p in enumerate(procs):
        out, _ = p.communicate(timeout=60)
        if i >= KILLED:
            assert p.returncode == 0, out
        reports.append(last_report(early[i] + out))
    total = {k: sum(r[k] for r in reports) for k in reports[0]}
    print("stress totals:", total)  # shown with pytest -s
    assert total["wrong"] == 0, reports
    assert total["foreign_ok"] == 0 and total["foreign_tries"] > 0, total
    assert total["checked"] > 0 and total["late_refused"] > 0, total
    assert total["batches"] > 0 and total["published"] > 0, total
    assert total["batch_late_refused"] > 0, total

    r = redis.Redis(port=srv.port, protocol=3)
    tiers = r.info("tiers")

    def settled() -> bool:
        nonlocal tiers
        tiers = r.info("tiers")
        return (
            tiers["kv_leases"] == 0 and tiers["kv_fenced_bytes"] == 0
            and tiers["dram_reserved"] == 0 and tiers["dram_held_slots"] == 0
        )  # fmt: skip

    assert wait_for(settled, limit=15.0), tiers
    assert tiers["kv_fenced_total"] > 0  # fences were made (and all ended)
    dram = r.execute_command("KV.STATS")[b"dram"]
    assert dram[b"used"] == dram[b"bytes"], dram  # only the listed chunks hold arena memory
    for key in r.scan_iter(match=f"kv:{NS}:*".encode(), count=1000):
        h = bytes.fromhex(key.decode().rsplit(":", 1)[1])
        got = r.execute_command("KV.GET", NS, h)
        if got is not None:
            size = (16384, 65536, 131072)[int(h[2:]) % 3]
            want = b"\xee" * size if int(h[:2]) >= 50 else h * (size // 8)
            assert got == want, f"chunk {h!r} is corrupt"
    r.close()
