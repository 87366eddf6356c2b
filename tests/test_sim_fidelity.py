"""Fidelity: the simulator, replaying a trace the server recorded, reports the hits and misses
per tier the server itself reported (KV.STATS), within 2 percentage points."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvstrata.clients.sync import Client
from kvstrata.config import OPTIONS
from kvstrata.sim.engine import Simulator
from kvstrata.sim.replay import replay
from kvstrata.sim.trace import read_trace
from kvstrata.sim.vtiers import TierSpec
from kvstrata.sim.workload import Workload, drive, generate
from kvstrata.store.policy import tier_policy
from tests.conftest import start_process_server

DRAM, NVME, CHUNK = 1 << 20, 4 << 20, 16 << 10


class ClientTarget:
    """The workload driver's target: a real server through the Python client. After each
    command it lets the server's background demoter finish (:meth:`settle`): the simulator
    completes background moves before the next command, as a server does whenever traffic
    leaves it the time (docs/simulate.md, "Fidelity")."""

    def __init__(self, client: Client) -> None:
        self.c = client

    def settle(self) -> None:
        """Poll INFO tiers until, ten times in a row, no chunk is moving and no tier is above its
        high mark (several times: a demoter between two rounds of victims, or between two
        tiers, has none in flight for a moment)."""
        calm = 0
        for _ in range(100_000):
            text = self.c.execute("INFO", "tiers")
            info = dict(
                line.split(":", 1)
                for line in (text.decode() if isinstance(text, bytes) else text).splitlines()
                if ":" in line
            )
            above = any(
                int(info[f"{t}_used"]) > 0.95 * int(info[f"{t}_capacity"]) for t in ("dram", "nvme")
            )
            calm = calm + 1 if info["kv_moves_in_flight"] == "0" and not above else 0
            if calm == 10:
                return
        raise AssertionError("the server's demoter did not settle")

    def match(self, ns: str, hashes: tuple[bytes, ...], tokens: int) -> int:
        found = int(self.c.match(ns, list(hashes)))
        self.settle()
        return found

    def get(self, ns: str, h: bytes) -> Any:
        self.c.get(ns, h)
        self.settle()

    def put(self, ns: str, h: bytes, parent: bytes, size: int, tokens: int) -> Any:
        self.c.put(ns, h, parent or None, bytes([h[0]]) * size, tokens=tokens)
        self.settle()

    def session(self, ns: str, sid: bytes, tail: bytes) -> Any:
        self.c.execute("KV.SESSION", ns, sid, tail)

    def prefetch_session(self, ns: str, sid: bytes) -> Any:
        return self.c.execute("KV.PREFETCH", ns, "SESSION", sid)


WORKLOAD = Workload(
    seed=7, duration=80, sessions_per_second=1.0, chunk_tokens=16, chunk_bytes=CHUNK,
    chat_turns=4, chat_user_tokens=24, chat_reply_tokens=40, agent_turns=6,
    agent_step_tokens=40, system_prompts=3, system_tokens=64, tool_schemas=2, tool_tokens=48,
    rag_docs=60, doc_tokens=64, docs_per_session=1, zipf=1.1,
)  # fmt: skip


def _ratio(row: dict[str, Any]) -> float:
    looked = row["hits"] + row["misses"]
    assert looked > 100, row  # enough lookups for a ratio to mean something
    return float(row["hits"]) / looked


def test_replayed_trace_agrees_with_server_stats(tmp_path: Path) -> None:
    """A DRAM + NVMe server (1 MiB + 4 MiB) records a generated multi-session workload (chats,
    agent loops, shared system prompts, Zipf-popular documents) driven through the Python
    client; the trace replayed with the same capacities gives the same hit ratio per tier."""
    trace = tmp_path / "trace.jsonl"
    srv = start_process_server(
        tmp_path / "data",
        dram_capacity=DRAM,
        nvme_capacity=NVME,
        trace_file=str(trace),
    )
    try:
        client = Client("127.0.0.1", srv.port)
        target = ClientTarget(client)
        for item in generate(WORKLOAD):
            drive(target, WORKLOAD, item, CHUNK)
        stats = client.stats()
    finally:
        srv.stop()
    defaults = {o.name: o.default for o in OPTIONS}
    sim = Simulator(
        [
            TierSpec("dram", DRAM, 64e9, 1e-5, tier_policy(defaults, "dram")),
            TierSpec("nvme", NVME, 14e9, 8e-5, tier_policy(defaults, "nvme")),
        ]
    )
    replay(sim, read_trace(trace))
    simulated = {t.name: t.counters.as_dict() for t in sim.tiers}
    for name in ("dram", "nvme"):
        server_ratio, sim_ratio = _ratio(stats[name]), _ratio(simulated[name])
        assert abs(server_ratio - sim_ratio) <= 0.02, (name, stats[name], simulated[name])
    # the workload exercised the hierarchy: DRAM missed, NVMe served and evicted
    assert stats["dram"]["misses"] > 0 and stats["nvme"]["hits"] > 0
    assert stats["nvme"]["evictions"] > 0 and simulated["nvme"]["evictions"] > 0
