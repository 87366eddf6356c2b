"""Simulation speed: chunk operations per second of ``kvstrata simulate`` on one core.

Three rows, measured in the same run on the same generated workload (multi-turn chats, agent
loops, shared system prompts, Zipf RAG documents):

- ``workload``: the generator driving the simulator (MATCH, GET, PUT, SESSION per turn);
- ``trace replay``: the same traffic read back from a JSON Lines trace (parsing included);
- ``peer: OrderedDict LRU``: the floor — one ``OrderedDict`` per chunk op (lookup, move to
  end, insert, pop the oldest), no tiers, no index, no policy.

    python bench/bench_sim.py [--duration 600] [--rounds 3]

Each is run ``--rounds`` times, alternating, and the best is printed with its ratio to the
peer (``vs peer``: the peer's time over the row's).
"""

from __future__ import annotations

import argparse
import io
import time
from collections import OrderedDict

from kvstrata.sim.economics import MODELS, hardware
from kvstrata.sim.engine import Simulator
from kvstrata.sim.replay import Plan, Ticking, replay, tier_specs
from kvstrata.sim.workload import Prefetch, Workload, drive, generate
from kvstrata.tracefile import Event, read_trace, write_trace


class Recorder:
    """A drive() target that writes the trace an engine would have caused."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = Ticking(sim)
        self.events: list[Event] = []
        self.t = 0.0

    def match(self, ns: str, hashes: tuple[bytes, ...], tokens: int) -> int:
        self.events.append(Event(self.t, "match", ns, hashes, tokens=tokens))
        self.sim.t = self.t
        return self.sim.match(ns, hashes, tokens)

    def get(self, ns: str, h: bytes) -> object:
        self.events.append(Event(self.t, "get", ns, (h,)))
        self.sim.t = self.t
        return self.sim.get(ns, h)

    def put(self, ns: str, h: bytes, parent: bytes, size: int, tokens: int) -> object:
        self.events.append(Event(self.t, "put", ns, (h,), parent, size, tokens))
        self.sim.t = self.t
        return self.sim.put(ns, h, parent, size, tokens)

    def session(self, ns: str, sid: bytes, tail: bytes) -> object:
        self.events.append(Event(self.t, "session", ns, (tail,), session=sid))
        self.sim.t = self.t
        return self.sim.session(ns, sid, tail)

    def prefetch_session(self, ns: str, sid: bytes, deadline_ms: int = 0) -> object:
        self.events.append(Event(self.t, "prefetch", ns, (), session=sid, deadline=deadline_ms))
        self.sim.t = self.t
        return self.sim.prefetch_session(ns, sid, deadline_ms)


def _peer(events: list[Event], cap: int, size: int) -> float:
    lru: OrderedDict[bytes, int] = OrderedDict()
    start = time.perf_counter()
    for ev in events:
        for h in ev.hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = size
                if len(lru) > cap:
                    lru.popitem(last=False)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--rounds", type=int, default=3, help="runs of each, alternating")
    args = ap.parse_args()
    wl = Workload(duration=args.duration, sessions_per_second=2.0, prefetch_lead=5.0)
    model = MODELS["llama-3-8b"]
    plan = Plan(dram=32 << 30, nvme=256 << 30, model=model, hardware=hardware())
    size = int(model.kv_size(wl.chunk_tokens))
    items = list(generate(wl))
    path = "/tmp/kvstrata-bench-sim.jsonl"
    times: dict[str, list[float]] = {"workload": [], "replay": [], "peer": []}
    ops = ops2 = 0
    events: list[Event] = []
    for _ in range(args.rounds):  # the three alternate, so a load spike hits each alike
        sim = Simulator(tier_specs(plan, hardware()))
        rec = Recorder(sim)
        start = time.perf_counter()
        ops = 0
        for item in items:
            rec.t = item.t
            ops += drive(rec, wl, item, size)
        times["workload"].append(time.perf_counter() - start)
        events = rec.events
        buf = io.StringIO()
        write_trace(events, buf)
        with open(path, "w") as f:
            f.write(buf.getvalue())
        sim2 = Simulator(tier_specs(plan, hardware()))
        start = time.perf_counter()
        ops2 = replay(sim2, read_trace(path))
        times["replay"].append(time.perf_counter() - start)
        assert sim2.by_name["dram"].counters == sim.by_name["dram"].counters  # same run, replayed
        times["peer"].append(_peer(events, (32 << 30) // size, size))

    turns = sum(1 for i in items if not isinstance(i, Prefetch))
    print(
        f"{turns} turns, {len(events)} commands, {ops} chunk ops; best of {args.rounds} "
        "alternating rounds\n"
    )
    print(f"{'run':<26}{'seconds':>9}{'chunk ops/s':>14}{'per minute':>14}{'vs peer':>9}")
    peer = min(times["peer"])
    for name, key, n in (
        ("workload (generator+sim)", "workload", ops),
        ("trace replay (JSONL)", "replay", ops2),
        ("peer: OrderedDict LRU", "peer", ops),
    ):
        secs = min(times[key])
        print(f"{name:<26}{secs:>9.2f}{n / secs:>14,.0f}{60 * n / secs:>14,.0f}{peer / secs:>9.3f}")


if __name__ == "__main__":
    main()
