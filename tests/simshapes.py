"""Generated workload shapes for the simulator's fidelity family (``test_sim_fidelity``).

A :class:`Shape` is drawn from a seed: chunk sizes around ``nvme-slab-max`` (slab slots of a
size class below it, chunk files above), write-back or write-through NVMe, optionally an S3
tier, and a mix of what engines do — sessions whose chains grow every turn, the matched prefix
read back (``KV.GET``, ``KV.MGET`` or a ``KV.LEASE`` held over the next turn), new chunks
written with ``Client.put_chain`` (``KV.MRESERVE`` + ``KV.COMMIT``) or ``KV.PUT`` (some with a
TTL), ``KV.DEL`` of a session's tail, ``KV.SESSION`` + ``KV.PREFETCH SESSION``.

:func:`drive` plays a shape against a real server (through the Python client, so the server
records the trace itself with ``--trace-file``); :func:`shares` turns KV.STATS-shaped counters
into the share of all reads each tier served (and the share that missed everywhere), the
figure the fidelity family compares between the server and the replayed trace.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstrata.clients.sync import Client
from kvstrata.protocol.errors import OutOfMemoryError

NS = "shape"
KIB = 1024


@dataclass(frozen=True, slots=True)
class Shape:
    """One generated workload and the capacities it runs at."""

    seed: int
    sizes: tuple[int, ...]  # chunk sizes drawn from (per chunk, by its hash)
    slab_max: int
    dram: int
    nvme: int
    write_through: bool
    s3: bool
    sessions: int
    turns: int
    grow: int  # chunks a session's chain grows by per turn
    lease: float = 0.0  # share of turns that read their prefix through a lease
    mget: float = 0.0  # share of turns that read with one KV.MGET
    delete: float = 0.0  # share of turns that end with KV.DEL of some session's tail
    ttl: float = 0.0  # share of single KV.PUT turns whose chunks get a TTL
    single: float = 0.0  # share of turns that write with KV.PUT instead of put_chain
    prefetch: float = 0.0  # share of turns preceded by KV.PREFETCH SESSION
    settle: bool = True  # wait for the demoter after every command (False: as fast as it goes)
    #: high watermark of dram and nvme (None: the server's defaults); 1.0 leaves all eviction
    #: to the writers' synchronous room making, which no background timing can change
    high: float | None = None
    #: ``prefetch-concurrency`` (1: one chunk after the other, an order no timing can change)
    prefetch_workers: int = 4

    def flags(self) -> dict[str, Any]:
        """The server's capacities and policy (``start_process_server`` overrides)."""
        out: dict[str, Any] = {
            "dram_capacity": self.dram,
            "nvme_capacity": self.nvme,
            "nvme_slab_max": self.slab_max,
            "prefetch_concurrency": self.prefetch_workers,
            "min_chunk_tokens": 1,  # (the DRAM floor is one such chunk: these arenas are small)
        }
        if self.write_through:
            out["nvme_write_policy"] = "write-through"
        if self.high is not None:
            for tier in ("dram", "nvme"):
                out[f"{tier}_high_watermark"] = self.high
                out[f"{tier}_low_watermark"] = min(self.high, 0.85)
        return out

    def values(self) -> dict[str, Any]:
        """The same as config values, for the simulator's tier policies."""
        return {k.replace("_", "-"): v for k, v in self.flags().items()}


def generate(seed: int, s3: bool = False) -> Shape:
    """A shape drawn from ``seed`` (small: a few hundred chunk operations)."""
    rng = random.Random(seed)
    slab = rng.choice((32, 64)) * KIB
    # around the limit: some slab classes (exact and between two classes), some chunk files
    sizes = tuple(
        sorted({rng.choice((12, 20, 24, 28)) * KIB, slab, slab + 4 * KIB, 2 * slab + 12 * KIB})
    )
    mean = sum(sizes) / len(sizes)
    return Shape(
        seed=seed,
        sizes=sizes,
        slab_max=slab,
        dram=int(mean * rng.choice((10, 14, 18))) // 4096 * 4096,
        nvme=int(mean * rng.choice((40, 56))) // 4096 * 4096,
        write_through=rng.random() < 0.5,
        s3=s3,
        sessions=rng.choice((6, 8, 10)),
        turns=rng.choice((50, 60)),
        grow=rng.choice((1, 2)),
        lease=rng.choice((0.0, 0.15)),
        mget=rng.choice((0.0, 0.3)),
        delete=rng.choice((0.0, 0.08)),
        ttl=rng.choice((0.0, 0.3)),
        single=rng.choice((0.2, 0.5)),
        prefetch=rng.choice((0.0, 0.25)),
    )


def chunk_hash(session: int, i: int) -> bytes:
    return hashlib.sha256(f"{session}/{i}".encode()).digest()


def chunk_size(shape: Shape, h: bytes) -> int:
    return shape.sizes[h[1] % len(shape.sizes)]


def _info(c: Client, section: str) -> dict[str, str]:
    text = c.execute("INFO", section)
    text = text.decode() if isinstance(text, bytes) else text
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def settle(c: Client, high: float = 0.95) -> None:
    """Poll INFO until, ten times in a row, no chunk is moving, no prefetch is queued or
    running and no tier is above its high mark (the server says when its background work is
    done; the test never guesses from its own clock)."""
    calm = 0
    for _ in range(100_000):
        info = {**_info(c, "tiers"), **_info(c, "prefetch")}
        above = any(
            int(info[f"{t}_used"]) > high * int(info[f"{t}_capacity"]) for t in ("dram", "nvme")
        )
        busy = info.get("prefetch_queued", "0") != "0" or info.get("prefetch_running", "0") != "0"
        calm = calm + 1 if info["kv_moves_in_flight"] == "0" and not above and not busy else 0
        if calm == 10:
            return
    raise AssertionError("the server's background work did not settle")


def _write(
    c: Client,
    shape: Shape,
    rng: random.Random,
    chain: list[bytes],
    n: int,
    step: Callable[[], None],
) -> None:
    rest = chain[n:]
    if not rest:
        return
    if rng.random() < shape.single:
        ttl = rng.choice((150, 400)) if rng.random() < shape.ttl else None
        for i in range(n, len(chain)):
            h = chain[i]
            try:
                c.put(NS, h, chain[i - 1] if i else None, bytes([h[0]]) * chunk_size(shape, h),
                      ttl_ms=ttl)  # fmt: skip
            except OutOfMemoryError:
                pass  # not stored (nothing in the trace): a tight, leased, fragmented tier
            step()
        return
    for k in range(n, len(chain), 2):  # small batches: lease-reserve-max-per-client
        part = chain[k : k + 2]
        payloads = [bytes([h[0]]) * chunk_size(shape, h) for h in part]
        try:
            c.put_chain(NS, part, payloads, parent=chain[k - 1] if k else None)
        except OutOfMemoryError:
            pass
        step()


def drive(c: Client, shape: Shape, on_turn: Callable[[int], None] | None = None) -> int:
    """Play ``shape`` against the server behind ``c``; the number of reads issued.
    ``on_turn(turn)`` is called after each turn (a debugging hook)."""
    rng = random.Random(shape.seed * 7919 + 1)

    def step() -> None:
        if shape.settle:
            settle(c, shape.high or 0.95)

    lengths = [0] * shape.sessions
    held: Any = None  # a lease kept over one turn (it pins its chunks meanwhile)
    reads = 0
    for turn in range(shape.turns):
        s = rng.randrange(shape.sessions)
        sid = f"s{s}".encode()
        if lengths[s] and rng.random() < shape.prefetch:
            c.execute("KV.PREFETCH", NS, "SESSION", sid)
            settle(
                c, shape.high or 0.95
            )  # (always: the simulator's prefetch is done before the next command)
        lengths[s] += shape.grow
        chain = [chunk_hash(s, i) for i in range(lengths[s])]
        n = int(c.match(NS, chain))
        if held is not None:
            c.execute("KV.RELEASE", held)
            held = None
            step()
        if n:
            roll = rng.random()
            if roll < shape.lease:
                reply = c.execute("KV.LEASE", NS, *chain[:n], "TIER", "dram")
                held = reply[0]
            elif roll < shape.lease + shape.mget:
                c.execute("KV.MGET", NS, *chain[:n])
            else:
                for h in chain[:n]:
                    c.get(NS, h)
                    step()
            step()
            reads += n
        _write(c, shape, rng, chain, n, step)
        c.execute("KV.SESSION", NS, sid, chain[-1])
        if rng.random() < shape.delete:
            victim = rng.randrange(shape.sessions)
            if lengths[victim]:
                c.execute("KV.DEL", NS, chunk_hash(victim, lengths[victim] - 1))
                lengths[victim] -= 1
                step()
        if on_turn is not None:
            on_turn(turn)
    if held is not None:
        c.execute("KV.RELEASE", held)
    return reads


def shares(counters: dict[str, dict[str, Any]], tiers: list[str]) -> dict[str, float]:
    """Share of all reads (points, 0–100) each tier served, and ``missed`` (in no tier). A
    read counts one hit in the tier that served it, or one miss in every tier."""
    hits = {t: int(counters[t]["hits"]) for t in tiers}
    missed = int(counters[tiers[-1]]["misses"])
    total = sum(hits.values()) + missed
    assert total > 0, counters
    out = {t: 100.0 * h / total for t, h in hits.items()}
    out["missed"] = 100.0 * missed / total
    return out
