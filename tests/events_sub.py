"""A KV-event subscriber for the tests, shaped like vLLM's ``kv_events_subscriber.py``: a SUB
socket, a replay socket asked for every gap in the sequence numbers. The server decides how
many messages exist (``INFO events``: ``kv_events_next_seq``); the subscriber gets each of them
once, from the stream or, when missed (a late join, a closed socket), through replay, and
records which."""

from __future__ import annotations

import time
from typing import Any

import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Subscriber:
    def __init__(self, endpoint: str, replay_endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.endpoint = endpoint
        self.replay = self.ctx.socket(zmq.DEALER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.connect(replay_endpoint)
        self.sub: Any = None
        self.open()
        #: seq → (topic, payload, "stream" | "replay")
        self.messages: dict[int, tuple[bytes, bytes, str]] = {}
        self.replays = 0

    def open(self) -> None:
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(self.endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")

    def close_stream(self) -> None:
        self.sub.close(linger=0)
        self.sub = None

    def close(self) -> None:
        if self.sub is not None:
            self.sub.close(linger=0)
        self.replay.close(linger=0)
        self.ctx.term()

    def _read_stream(self, timeout_ms: int) -> None:
        if self.sub is None:
            return
        while self.sub.poll(timeout_ms):
            topic, seq, payload = self.sub.recv_multipart()
            self.messages.setdefault(int.from_bytes(seq, "big"), (topic, payload, "stream"))
            timeout_ms = 0

    def replay_from(self, start: int, timeout: float = 5.0) -> None:
        self.replays += 1
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.replay.poll(100):
                continue
            _, topic, seq, payload = self.replay.recv_multipart()
            if seq == END_SEQ:
                return
            self.messages.setdefault(int.from_bytes(seq, "big"), (topic, payload, "replay"))
        raise AssertionError(f"replay from {start} did not end within {timeout} s")

    def catch_up(self, next_seq: int, timeout: float = 20.0) -> None:
        """Until every message below ``next_seq`` is here: read the stream, replay the gaps."""
        deadline = time.monotonic() + timeout
        while True:
            self._read_stream(50)
            missing = [s for s in range(next_seq) if s not in self.messages]
            if not missing:
                return
            assert time.monotonic() < deadline, f"messages {missing[:5]}… never arrived"
            self.replay_from(missing[0])

    def ordered(self) -> list[tuple[int, bytes, bytes, str]]:
        return [(s, *self.messages[s]) for s in sorted(self.messages)]


def next_seq(client: Any) -> int:
    """The sequence number the server gives its next message (every earlier one is sent)."""
    return int(client.info("events")["kv_events_next_seq"])


def wait_events(
    client: Any, sub: Subscriber, decode: Any, count: int, timeout: float = 20.0
) -> list[tuple[int, Any]]:
    """(seq, event) of every event so far, in order, once at least ``count`` are out."""
    deadline = time.monotonic() + timeout
    while True:
        sub.catch_up(next_seq(client))
        flat = [(seq, ev) for seq, _t, payload, _src in sub.ordered()
                for ev in decode(payload)]  # fmt: skip
        if len(flat) >= count:
            return flat
        assert time.monotonic() < deadline, f"{len(flat)} events, wanted {count}: {flat}"
        time.sleep(0.02)
