"""KV events (``kv-events-endpoint``): what a router subscribed to a node sees, decoded from the
wire (msgpack, vLLM's field names), through real ZMQ sockets on loopback and real redis-py
clients. The exact decoding with vLLM's own classes is tests/engines/vllm/test_events.py."""

from __future__ import annotations

import hashlib
import statistics
import subprocess
import sys
import time
from typing import Any

import msgspec
import pytest
import redis
import zmq

from tests.conftest import free_port
from tests.events_sub import Subscriber, next_seq, wait_events

NS = "llama-3.1-8b@bf16@tp1r0@c16"


def _decode(payload: bytes) -> list[dict[str, Any]]:
    ts, events, dp_rank = msgspec.msgpack.decode(payload)
    assert isinstance(ts, float) and dp_rank == 0
    return events


def _h(i: int, salt: bytes = b"") -> bytes:
    return hashlib.sha256(salt + b"%d" % i).digest()


def _wire(h: bytes) -> int:
    return int.from_bytes(h, "big") & (2**64 - 1)


def _ids(n: int, start: int = 0) -> bytes:
    return b"".join((start + i).to_bytes(4, "little") for i in range(n))


@pytest.fixture
def events_server(make_server):
    def make(**overrides: Any) -> tuple[Any, redis.Redis, Subscriber]:
        pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        srv = make_server(kv_events_endpoint=pub, kv_events_replay_endpoint=rep, **overrides)
        sub = Subscriber(pub, rep)
        made.append(sub)
        return srv, redis.Redis(port=srv.port), sub

    made: list[Subscriber] = []
    yield make
    for sub in made:
        sub.close()


def _short(events: list[tuple[int, dict[str, Any]]]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for _seq, ev in events:
        if ev["type"] == "AllBlocksCleared":
            out.append(("cleared",))
        elif ev["type"] == "BlockStored":
            out.append(("stored", ev["block_hashes"][0], ev["medium"]))
        else:
            out.append(("removed", ev["block_hashes"][0], ev["medium"]))
    return out


def test_put_delete_expiry_flushall_in_order(events_server) -> None:
    """Scenario: a node starts (AllBlocksCleared first), a client stores a chain of three with
    token ids, deletes the middle one (and, by CASCADE, its child), stores one with a TTL that
    then expires, and flushes everything: the router sees exactly those events, sequence numbers
    without holes, and the FLUSHALL as one AllBlocksCleared (no removal per chunk)."""
    _srv, r, sub = events_server(kv_events_models="llama-3.1-8b@*=meta-llama/Llama-3.1-8B;7;ad")
    h = [_h(i) for i in range(4)]
    for i in range(3):
        r.execute_command("KV.PUT", NS, h[i], h[i - 1] if i else b"", b"x" * 64,
                          "TOKENIDS", _ids(16, 16 * i))  # fmt: skip
    assert r.execute_command("KV.DEL", NS, h[1], "CASCADE") == 2
    r.execute_command("KV.PUT", NS, h[3], b"", b"y" * 64, "TOKENS", 16, "TTL", 1)
    deadline = time.monotonic() + 10
    while r.execute_command("KV.INFO", NS, h[3]) is not None:  # the server expires it
        assert time.monotonic() < deadline
        time.sleep(0.01)
    r.flushall()
    events = wait_events(r, sub, _decode, 9)
    assert len(events) == 9
    assert sorted(sub.messages) == list(range(next_seq(r)))  # no hole
    cpu = "CPU_PINNED"
    w = [_wire(x) for x in h]
    short = _short(events)
    assert short[:4] == [("cleared",), ("stored", w[0], cpu), ("stored", w[1], cpu),
                         ("stored", w[2], cpu)]  # fmt: skip
    assert sorted(short[4:6]) == sorted([("removed", w[1], cpu), ("removed", w[2], cpu)])
    assert short[6:] == [("stored", w[3], cpu), ("removed", w[3], cpu), ("cleared",)]
    stored = [ev for _, ev in events if ev["type"] == "BlockStored"]
    assert [ev["parent_block_hash"] for ev in stored[:3]] == [None, w[0], w[1]]
    assert stored[1]["token_ids"] == list(range(16, 32))
    assert stored[3]["token_ids"] == []  # stored without TOKENIDS
    assert {(ev["block_size"], ev["lora_id"], ev["lora_name"]) for ev in stored} == {(16, 7, "ad")}
    topics = {t for _s, t, _p, _src in sub.ordered()}
    node = r.info("events")["kv_events_node"]
    assert f"kv@{node}@meta-llama/Llama-3.1-8B".encode() in topics
    info = r.info("events")
    assert info["kv_events_dropped"] == 0 and info["kv_events_token_chunks"] == 0


def test_token_ids_are_checked_and_their_memory_counted(events_server) -> None:
    _srv, r, _sub = events_server()
    with pytest.raises(redis.ResponseError, match="TOKENIDS: 3 token ids for TOKENS 4"):
        r.execute_command("KV.PUT", NS, _h(0), b"", b"x", "TOKENS", 4, "TOKENIDS", _ids(3))
    with pytest.raises(redis.ResponseError, match="multiple of 4"):
        r.execute_command("KV.PUT", NS, _h(0), b"", b"x", "TOKENIDS", b"abc")
    r.execute_command("KV.PUT", NS, _h(0), b"", b"x", "TOKENIDS", _ids(32))
    assert r.execute_command("KV.INFO", NS, _h(0))[b"tokens"] == 32  # TOKENS from the ids
    info = r.info("events")
    assert (info["kv_events_token_chunks"], info["kv_events_token_bytes"]) == (1, 128)
    r.execute_command("KV.DEL", NS, _h(0))
    assert r.info("events")["kv_events_token_bytes"] == 0


def test_off_by_default_and_the_extra_is_only_needed_when_on(make_server, tmp_path) -> None:
    r = redis.Redis(port=make_server().port)
    assert r.info("events") == {"kv_events": 0}
    assert r.ping()
    # Without pyzmq: the server still starts when events are off, and says what to install
    # when they are on.
    blocked = "import sys; sys.modules['zmq'] = None; from kvstrata.cli import main; "
    off = subprocess.run(
        [sys.executable, "-c", blocked + "import kvstrata.server.events as e; "
         "print(e.events_available())"], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert off.stdout.strip() == "False", off.stderr
    on = subprocess.run(
        [sys.executable, "-c", blocked + "sys.exit(main(sys.argv[1:]))", "serve", "--port", "0",
         "--data-dir", str(tmp_path / "d"), "--nvme-capacity", "0",
         "--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert on.returncode == 2
    assert "kvstrata[events]" in on.stderr and "Traceback" not in on.stderr


def test_bad_settings_are_clear_errors(make_server) -> None:
    from kvstrata.config import ConfigError

    with pytest.raises(ConfigError, match="kv-events-models"):
        make_server(kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}", kv_events_models="x")
    with pytest.raises(ConfigError, match="kv-events-topic"):
        make_server(kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}",
                    kv_events_topic="{pod}")  # fmt: skip
    with pytest.raises(ConfigError, match="needs kv-events-endpoint"):
        make_server(kv_events_replay_endpoint=f"tcp://127.0.0.1:{free_port()}")


def _ping_rtts(r: redis.Redis, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        r.ping()
        out.append(time.perf_counter() - t)
    return out


def _ping_rate(r: redis.Redis, n: int) -> float:
    pipe = r.pipeline(transaction=False)
    for _ in range(n):
        pipe.ping()
    t = time.perf_counter()
    pipe.execute()
    return n / (time.perf_counter() - t)


def test_a_subscriber_that_stops_reading_costs_the_server_nothing(make_server) -> None:
    """Scenario: a router subscribes and then stops reading (its socket stays open, its receive
    buffer small). A writer keeps storing chunks with token ids on that node and on a node with
    events off; PINGs are timed on both, alternately, while the writes go on. The stalled
    node's PING latency and throughput stay within a generous bound of the other's (a loop
    waiting on the subscriber would time out), and INFO counts the events it dropped."""
    pub = f"tcp://127.0.0.1:{free_port()}"
    on = make_server(kv_events_endpoint=pub, kv_events_hwm=4, dram_capacity="256MiB")
    off = make_server(dram_capacity="256MiB")
    ctx = zmq.Context()
    stalled = ctx.socket(zmq.SUB)
    stalled.setsockopt(zmq.RCVHWM, 1)
    stalled.setsockopt(zmq.RCVBUF, 4096)
    stalled.connect(pub)
    stalled.setsockopt(zmq.SUBSCRIBE, b"")
    clients = {"on": redis.Redis(port=on.port), "off": redis.Redis(port=off.port)}
    rtts: dict[str, list[float]] = {"on": [], "off": []}
    rates: dict[str, list[float]] = {"on": [], "off": []}
    ids = _ids(256)
    try:
        for rnd in range(60):
            for name, r in clients.items():
                pipe = r.pipeline(transaction=False)
                for i in range(200):
                    pipe.execute_command("KV.PUT", NS, _h(i, b"%d" % rnd), b"", b"p" * 64,
                                         "TOKENIDS", ids)  # fmt: skip
                pipe.execute()
                rtts[name] += _ping_rtts(r, 50)
                rates[name].append(_ping_rate(r, 500))
            if rnd >= 5 and clients["on"].info("events")["kv_events_dropped"] > 0:
                break
        info = clients["on"].info("events")
        assert info["kv_events_dropped"] > 0 and info["kv_events_dropped_messages"] > 0
        assert info["kv_events_messages"] + info["kv_events_dropped_messages"] == next_seq(
            clients["on"]
        )
        med_on, med_off = statistics.median(rtts["on"]), statistics.median(rtts["off"])
        rate_on, rate_off = statistics.median(rates["on"]), statistics.median(rates["off"])
        print(f"rounds {rnd + 1}, dropped {info['kv_events_dropped']}, PING median "
              f"{med_on * 1e6:.0f} vs {med_off * 1e6:.0f} us, "
              f"rate {rate_on:.0f} vs {rate_off:.0f}/s")
        assert med_on <= 3 * med_off + 0.002, (med_on, med_off)
        assert max(rtts["on"]) < 1.0  # never waited for the subscriber
        assert rate_on >= 0.33 * rate_off, (rate_on, rate_off)
    finally:
        stalled.close(linger=0)
        ctx.term()


def test_batch_reservation_carries_token_ids_to_commit(events_server) -> None:
    """KV.MRESERVE … TOKENIDS: each chunk's share of the ids goes out when KV.COMMIT publishes
    it; ids that do not split evenly are refused."""
    _srv, r, sub = events_server()
    h = [_h(i, b"batch") for i in range(2)]
    with pytest.raises(redis.ResponseError, match="TOKENIDS: 31 token ids for 2 chunks"):
        r.execute_command("KV.MRESERVE", NS, b"", 2, h[0], 4096, h[1], 4096,
                          "TOKENIDS", _ids(31))  # fmt: skip
    lease, entries = r.execute_command("KV.MRESERVE", NS, b"", 2, h[0], 4096, h[1], 4096,
                                       "TOKENIDS", _ids(32))  # fmt: skip
    assert len(entries) == 2 and lease is not None
    r.execute_command("KV.COMMIT", lease)
    events = wait_events(r, sub, _decode, 3)
    stored = [ev for _, ev in events if ev["type"] == "BlockStored"]
    assert [ev["block_hashes"][0] for ev in stored] == [_wire(h[0]), _wire(h[1])]
    assert [ev["token_ids"] for ev in stored] == [list(range(16)), list(range(16, 32))]
    assert stored[1]["parent_block_hash"] == _wire(h[0])
    assert {ev["block_size"] for ev in stored} == {16}


class _OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    """The array_like events of earlier vLLM releases (its kv_events_subscriber.py then), the
    layout llm-d's kv-cache-manager decodes."""


class _OldStored(_OldEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class _OldRemoved(_OldEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class _OldCleared(_OldEvent, tag="AllBlocksCleared"):
    pass


class _OldBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_OldStored | _OldRemoved | _OldCleared]
    data_parallel_rank: int | None = None


def test_array_events_for_older_decoders(events_server) -> None:
    """kv-events-event-format array: decoded strictly by the array_like structs of earlier vLLM
    releases (llm-d's layout), topic kv@<node>@<model> split in exactly three parts."""
    _srv, r, sub = events_server(kv_events_event_format="array", kv_events_node="pod-1")
    r.execute_command("KV.PUT", NS, _h(0), b"", b"x", "TOKENIDS", _ids(16))
    r.execute_command("KV.DEL", NS, _h(0))
    decoder = msgspec.msgpack.Decoder(_OldBatch)
    events = wait_events(r, sub, lambda p: decoder.decode(p).events, 3)
    assert isinstance(events[0][1], _OldCleared)
    assert events[1][1] == _OldStored([_wire(_h(0))], None, list(range(16)), 16, None, "CPU_PINNED")
    assert events[2][1] == _OldRemoved([_wire(_h(0))], "CPU_PINNED")
    topics = {t.decode().split("@")[1:] == ["pod-1", "llama-3.1-8b"] for _s, t, _p, _r in
              sub.ordered()[1:]}  # fmt: skip
    assert topics == {True}


def test_a_restart_clears_then_announces_what_nvme_kept(make_process_server, tmp_path) -> None:
    """Scenario: chunks written through to NVMe; the server is restarted on the same data
    folder. Its new stream starts with AllBlocksCleared (the router forgets the old life), then
    one BlockStored DISK per chunk the NVMe index rebuild found (token ids are not kept)."""
    data = tmp_path / "data"
    first = make_process_server(data_dir=data, nvme_write_policy="write-through")
    r = redis.Redis(port=first.port)
    for i in range(3):
        r.execute_command("KV.PUT", NS, _h(i, b"keep"), _h(i - 1, b"keep") if i else b"",
                          b"z" * 4096, "TOKENS", 16)  # fmt: skip
    first.stop()
    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    again = make_process_server(data_dir=data, kv_events_endpoint=pub,
                                kv_events_replay_endpoint=rep)  # fmt: skip
    sub = Subscriber(pub, rep)
    try:
        r = redis.Redis(port=again.port)
        events = [ev for _, ev in wait_events(r, sub, _decode, 4)]
        assert events[0] == {"type": "AllBlocksCleared"}
        assert sorted(_short([(0, ev) for ev in events[1:]])) == sorted(
            ("stored", _wire(_h(i, b"keep")), "DISK") for i in range(3)
        )
        assert all(ev["token_ids"] == [] for ev in events[1:])
    finally:
        sub.close()
