"""KV events: what publishing them costs a KV.PUT, and how many events per second go out.

    python bench/bench_events.py                  # 5 rounds of 20,000 KV.PUT per server
    python bench/bench_events.py --puts 50000 --token-ids 256

Two ``kvstrata serve`` processes side by side: one with ``kv-events-endpoint`` (and a
subscriber that reads every message, so nothing is dropped), one without. Each round sends the
same pipelined KV.PUTs (small payloads, optionally with TOKENIDS) to both, alternately, then
deletes them (BlockRemoved). The table gives the server CPU per command (from /proc) and the
wall time, off and on; the events the server published (INFO events) per second of its
wall time and per second of its CPU; and what the subscriber received. Measured on whatever
machine runs it: on a shared, loaded machine compare the ratio, not the absolute figures.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis
import zmq

from bench._servers import Proc, free_port, kvstrata_server

NS = "bench-events@bf16@c256"


class Counter(threading.Thread):
    """Reads every message of the stream (zmq releases the GIL while it waits)."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.connect(endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.messages = 0
        self.bytes = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if self.sub.poll(100):
                while True:
                    try:
                        frames = self.sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.messages += 1
                    self.bytes += len(frames[2])


def one_round(proc: Proc, rnd: int, args: argparse.Namespace, ids: bytes) -> tuple[float, float]:
    """(server CPU s, wall s) for ``args.puts`` KV.PUT and as many KV.DEL."""
    r = redis.Redis(port=proc.port)
    hashes = [hashlib.sha256(b"%d-%d" % (rnd, i)).digest() for i in range(args.puts)]
    extra = ("TOKENIDS", ids) if ids else ("TOKENS", 256)
    payload = b"p" * args.payload
    cpu0, t0 = proc.cpu_seconds(), time.perf_counter()
    for start in range(0, args.puts, args.pipeline):
        pipe = r.pipeline(transaction=False)
        for i in range(start, min(start + args.pipeline, args.puts)):
            pipe.execute_command("KV.PUT", NS, hashes[i], hashes[i - 1] if i else b"", payload,
                                 *extra)  # fmt: skip
        pipe.execute()
    for start in range(0, args.puts, args.pipeline):
        pipe = r.pipeline(transaction=False)
        for i in range(start, min(start + args.pipeline, args.puts)):
            pipe.execute_command("KV.DEL", NS, hashes[i])
        pipe.execute()
    return proc.cpu_seconds() - cpu0, time.perf_counter() - t0


def publisher_ceiling(events: int, per_flush: int, token_ids: int) -> float:
    """Events per second the publisher alone encodes and sends (in this process, with a
    subscriber reading): the ceiling of what a server can publish, whatever else it does."""
    from kvstrata.config import load_config
    from kvstrata.server.events import ZmqPublisher
    from kvstrata.store.events import STORED

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = ZmqPublisher(load_config(flags={"kv-events-endpoint": endpoint}, env={}), "bench")
    pub._pub.bind(endpoint)  # start() would also serve replays from a running loop
    counter = Counter(endpoint)
    counter.start()
    time.sleep(0.3)
    ids = b"".join(i.to_bytes(4, "little") for i in range(token_ids))
    batch = [(STORED, NS, hashlib.sha256(b"%d" % i).digest(), b"\x01" * 32, 256, "CPU_PINNED", ids)
             for i in range(per_flush)]  # fmt: skip
    t = time.perf_counter()
    for _ in range(events // per_flush):
        pub.send(batch)
    elapsed = time.perf_counter() - t
    counter.stop.set()
    pub.close()
    return events / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--puts", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pipeline", type=int, default=100)
    ap.add_argument("--payload", type=int, default=1024)
    ap.add_argument("--token-ids", type=int, default=0, help="TOKENIDS per chunk (0: none)")
    args = ap.parse_args()
    for per_flush in (1, 100):
        rate = publisher_ceiling(50000, per_flush, args.token_ids)
        print(f"publisher alone, {per_flush:3} events per flush: {rate:,.0f} events/s")
    ids = b"".join(i.to_bytes(4, "little") for i in range(args.token_ids))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    common = ("--nvme-capacity", "0", "--dram-capacity", "512MiB")
    with kvstrata_server(*common) as off, kvstrata_server(
        *common, "--kv-events-endpoint", endpoint
    ) as on:
        counter = Counter(endpoint)
        counter.start()
        time.sleep(0.5)  # the subscription reaches the publisher (a benchmark, not a test)
        results: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
        one_round(off, -1, args, ids)  # warm-up
        one_round(on, -1, args, ids)
        before = redis.Redis(port=on.port).info("events")
        for rnd in range(args.rounds):
            for name, proc in (("off", off), ("on", on)) if rnd % 2 else (("on", on), ("off", off)):
                results[name].append(one_round(proc, rnd, args, ids))
        after = redis.Redis(port=on.port).info("events")
        deadline = time.monotonic() + 10
        while counter.messages < after["kv_events_messages"] and time.monotonic() < deadline:
            time.sleep(0.05)
        counter.stop.set()
    commands = 2 * args.puts
    rows = []
    for name in ("off", "on"):
        cpu = statistics.median(c for c, _ in results[name]) / commands * 1e6
        wall = statistics.median(w for _, w in results[name]) / commands * 1e6
        rows.append((name, cpu, wall))
    sent = after["kv_events_sent"] - before["kv_events_sent"]
    on_cpu = sum(c for c, _ in results["on"])
    on_wall = sum(w for _, w in results["on"])
    print(f"{args.rounds} rounds x ({args.puts} KV.PUT + {args.puts} KV.DEL), pipeline "
          f"{args.pipeline}, payload {args.payload} B, TOKENIDS {args.token_ids} per chunk")
    print(f"{'events':8} {'server CPU/cmd':>15} {'wall/cmd':>10}")
    for name, cpu, wall in rows:
        print(f"{name:8} {cpu:12.2f} us {wall:7.2f} us")
    print(f"on/off   {rows[1][1] / rows[0][1]:14.2f}x {rows[1][2] / rows[0][2]:9.2f}x")
    print(f"events published: {sent} ({sent / on_wall:,.0f}/s of wall time, "
          f"{sent / on_cpu:,.0f}/s of server CPU), dropped {after['kv_events_dropped']}")
    print(f"subscriber received {counter.messages} messages, {counter.bytes / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
