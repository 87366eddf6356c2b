"""Scenarios across processes: leases of a killed client expire, and a second process reads
through a lease exactly the bytes another process wrote with RESERVE/COMMIT, in place."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import redis

NS = "proc@u8@c16"
CHILD = textwrap.dedent(
    """
    import sys, time
    from kvstrata.clients import Client
    port, ns = int(sys.argv[1]), sys.argv[2]
    with Client(port=port) as kv:
        lease = kv.lease(ns, [b"a", b"b"], ttl_ms=400)
        w = kv.reserve(ns, b"w", None, 1 << 20, ttl_ms=400)
        w.view()[:4] = b"half"
        print("ready", lease.lease_id, flush=True)
        time.sleep(60)  # killed before it releases or commits anything
    """
)


def _stats(r: redis.Redis) -> dict[bytes, int]:
    return r.execute_command("KV.STATS")[b"dram"]


def test_leases_of_a_killed_client_expire(make_process_server) -> None:
    """Scenario: a client process leases two chunks and reserves a 1 MiB slot, then is killed
    with SIGKILL. After the lease TTL the server has released the pins and freed the slot:
    KV.INFO shows no leases, DRAM use is back where it was, and the reserved chunk never
    became visible."""
    srv = make_process_server()
    r = redis.Redis(port=srv.port, protocol=3)
    for h, parent in ((b"a", b""), (b"b", b"a")):
        assert r.execute_command("KV.PUT", NS, h, parent, os.urandom(100_000)) == 1
    used_before = _stats(r)[b"used"]
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(srv.port), NS],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line.startswith("ready")
    assert r.execute_command("KV.INFO", NS, b"a")[b"leases"] == 1
    assert _stats(r)[b"used"] >= used_before + (1 << 20)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if r.execute_command("KV.INFO", NS, b"a")[b"leases"] == 0 and (
            _stats(r)[b"used"] == used_before
        ):
            break
        time.sleep(0.1)
    assert r.execute_command("KV.INFO", NS, b"a")[b"leases"] == 0
    assert r.execute_command("KV.INFO", NS, b"b")[b"leases"] == 0
    assert _stats(r)[b"used"] == used_before
    assert r.execute_command("KV.GET", NS, b"w") is None
    assert r.execute_command("KV.MATCH", NS, b"a", b"b") == 2  # the chunks themselves stay


WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from kvstrata.clients import Client
    port, ns = int(sys.argv[1]), sys.argv[2]
    with Client(port=port) as kv:
        with kv.reserve(ns, b"z", None, 1 << 20, tokens=16) as w:
            arr = w.array()
            arr[:] = np.arange(1 << 20, dtype=np.uint64).astype(np.uint8)
            print(w.handle.region, w.handle.offset, flush=True)
    """
)
READER = textwrap.dedent(
    """
    import sys, hashlib
    from kvstrata.clients import Client
    port, ns = int(sys.argv[1]), sys.argv[2]
    with Client(port=port) as kv:
        with kv.lease(ns, [b"z"]) as lease:
            h = lease.handles[0]
            print(h.region, h.offset, hashlib.sha256(lease.views()[0]).hexdigest(), flush=True)
    """
)


def test_second_process_reads_reserved_bytes_in_place(make_process_server) -> None:
    """Scenario: process A reserves a slot, fills it through its shared-memory view and
    commits; process B leases the chunk and reads exactly those bytes from the same region
    and offset (the commit published the slot A wrote: no copy)."""
    import hashlib

    import numpy as np

    srv = make_process_server()
    wrote = subprocess.run([sys.executable, "-c", WRITER, str(srv.port), NS],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert wrote.returncode == 0, wrote.stderr
    w_region, w_offset = wrote.stdout.split()
    read = subprocess.run([sys.executable, "-c", READER, str(srv.port), NS],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert read.returncode == 0, read.stderr
    r_region, r_offset, digest = read.stdout.split()
    expected = np.arange(1 << 20, dtype=np.uint64).astype(np.uint8).tobytes()
    assert (r_region, r_offset) == (w_region, w_offset)
    assert digest == hashlib.sha256(expected).hexdigest()
    r = redis.Redis(port=srv.port)
    assert r.execute_command("KV.GET", NS, b"z") == expected


def test_client_remaps_regions_after_a_server_restart(make_process_server, tmp_path) -> None:
    """Scenario: a long-lived client leases chunks from a server, the server restarts on the
    same port (its arena is a new shared-memory segment under the same region name), and the
    client leases again: it must read the new server's bytes, not the old mapping's."""
    from kvstrata.clients import Client
    from tests.conftest import free_port

    MiB = 1 << 20
    port = free_port()
    first = make_process_server(data_dir=tmp_path / "a", port=port, nvme_capacity=0)
    with Client(port=port) as kv:
        kv.put(NS, b"h1", None, b"A" * MiB)
        kv.put(NS, b"h2", b"h1", b"B" * MiB)
        with kv.lease(NS, [b"h1"]) as lease:
            assert bytes(lease.views()[0][:4]) == b"AAAA"
        first.stop()
        make_process_server(data_dir=tmp_path / "b", port=port, nvme_capacity=0)
        deadline = time.monotonic() + 10
        while True:
            try:
                kv.put(NS, b"h3", None, b"C" * MiB)
                break
            except Exception:  # the pool's old connections fail until they are replaced
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        kv.put(NS, b"h1", b"h3", b"D" * MiB)
        with kv.lease(NS, [b"h1"]) as lease:
            assert bytes(lease.views()[0]) == b"D" * MiB
