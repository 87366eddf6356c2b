"""The KV-event publisher: the tiers' contents as vLLM KV events on ZMQ (``kv-events-endpoint``).

Routers that follow vLLM engines (Dynamo's ZMQ relay, llm-d's indexer, vLLM's example
subscriber) read a stream of ``KVEventBatch`` messages; this module writes that stream from the
store's tier events (``kvstrata.store.events``), in the wire format of vLLM 0.33
(``vllm/distributed/kv_events.py``):

- PUB socket, three frames per message: topic, sequence number (8 bytes, big endian, from 0,
  one per message), payload;
- payload: msgpack of ``KVEventBatch``, an ``array_like`` struct ``[ts, events,
  data_parallel_rank]``; each event a map tagged ``"type"`` (``BlockStored``,
  ``BlockRemoved``, ``AllBlocksCleared``) with vLLM's field names (``kv-events-event-format
  array``: the ``array_like`` events of earlier vLLM releases, ``[tag, field, …]``, which
  llm-d's kv-cache-manager decodes);
- ROUTER replay socket (``kv-events-replay-endpoint``): a request ``[identity, "", start seq (8
  bytes big endian)]`` gets every kept message from that sequence number on as ``[identity, "",
  topic, seq, payload]``, then ``[identity, "", "", -1 (8 bytes), ""]``.

Nothing here blocks the event loop: each flush's events (``store.events``: a millisecond of
them) go out as messages of at most :data:`MAX_EVENTS` events, sent with ``NOBLOCK`` on a
socket with ``XPUB_NODROP`` and a high-water mark (``kv-events-hwm`` messages): when a
subscriber's queue is full the message is dropped and counted (``INFO events``), never waited
for; it stays in the replay buffer (the newest ``kv-events-buffer`` bytes of messages), so a
subscriber that sees a gap in the sequence numbers can ask for it. The replay socket is served
from the loop when ZMQ says it is readable; at most :data:`REPLAY_HWM` messages are queued per
requester (a larger replay is cut short: the requester sees the gap that remains and asks again
from there).

Needs the optional ``events`` extra (pyzmq, msgspec); without it the server starts unless
``kv-events-endpoint`` is set, and then stops with :data:`INSTALL_HINT`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
import time
from collections import deque
from typing import Any

from kvstrata.config import Config, ConfigError
from kvstrata.store.events import CLEARED, REMOVED, STORED, Event
from kvstrata.store.glob import glob_match

log = logging.getLogger("kvstrata.events")

INSTALL_HINT = (
    "kv-events-endpoint needs the 'events' extra (pyzmq, msgspec): "
    "python3 -m pip install 'kvstrata[events]'"
)
#: most events in one message (a flush with more sends several)
MAX_EVENTS = 256
#: most replayed messages queued for one requester
REPLAY_HWM = 4096
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_MASK64 = (1 << 64) - 1


def events_available() -> bool:
    try:
        import msgspec  # noqa: F401
        import zmq  # noqa: F401
    except ImportError:
        return False
    return True


def node_name(config: Config, port: int) -> str:
    """``kv-events-node``, or ``hostname:port``: the node's name in topics and poll replies."""
    return str(config.values["kv-events-node"]) or f"{socket.gethostname()}:{port}"


def wire_hash(digest: bytes, fmt: str) -> int | bytes:
    """A chunk hash as the events carry it: ``int64`` is vLLM's own conversion of its block
    hashes (``maybe_convert_block_hash``: the hash as a big-endian integer, low 64 bits), so a
    vLLM block hash stored as the chunk's hash matches vLLM's own events; ``bytes`` as is."""
    if fmt == "bytes":
        return digest
    return int.from_bytes(digest, "big") & _MASK64


class ModelMap:
    """``kv-events-models``: ``GLOB=MODEL[;LORA_ID[;LORA_NAME]]`` entries (space separated),
    first match wins; a namespace no entry names is its text up to the first ``@``."""

    def __init__(self, spec: str) -> None:
        self.rules: list[tuple[bytes, str, int | None, str | None]] = []
        for entry in spec.split():
            glob, sep, right = entry.rpartition("=")
            parts = right.split(";")
            if not sep or not glob or not parts[0] or len(parts) > 3:
                raise ConfigError(
                    f"invalid value for 'kv-events-models': {entry!r} is not "
                    "NAMESPACE-GLOB=MODEL[;LORA_ID[;LORA_NAME]]"
                )
            try:
                lora_id = int(parts[1]) if len(parts) > 1 and parts[1] else None
            except ValueError:
                raise ConfigError(
                    f"invalid value for 'kv-events-models': LoRA id {parts[1]!r} of {entry!r} "
                    "is not an integer"
                ) from None
            lora_name = parts[2] if len(parts) > 2 and parts[2] else None
            self.rules.append((glob.encode(), parts[0], lora_id, lora_name))
        self._cache: dict[str, tuple[str, int | None, str | None]] = {}

    def lookup(self, namespace: str) -> tuple[str, int | None, str | None]:
        """(model, LoRA id, LoRA name) of a namespace."""
        found = self._cache.get(namespace)
        if found is None:
            found = (namespace.split("@", 1)[0], None, None)
            for glob, model, lora_id, lora_name in self.rules:
                if glob_match(glob, namespace.encode()):
                    found = (model, lora_id, lora_name)
                    break
            if len(self._cache) < 4096:
                self._cache[namespace] = found
        return found


def _token_list(ids: bytes) -> list[int]:
    view = memoryview(ids).cast("I")
    if sys.byteorder == "little":
        return view.tolist()
    return [int.from_bytes(ids[i : i + 4], "little") for i in range(0, len(ids), 4)]


class Counters:
    def __init__(self) -> None:
        self.messages = 0
        self.events = 0
        self.dropped_messages = 0
        self.dropped_events = 0
        self.replay_requests = 0
        self.replayed_messages = 0
        self.errors = 0


class ZmqPublisher:
    """See the module docstring. ``send`` is the store's sink; ``start`` binds the sockets."""

    def __init__(self, config: Config, node: str) -> None:
        if not events_available():
            raise ConfigError(INSTALL_HINT)
        import msgspec
        import zmq

        values = config.values
        self._zmq = zmq
        self.node = node
        self.endpoint = str(values["kv-events-endpoint"])
        self.replay_endpoint = str(values["kv-events-replay-endpoint"])
        self.hash_format = str(values["kv-events-hash-format"])
        self.arrays = values["kv-events-event-format"] == "array"
        self.topic_template = str(values["kv-events-topic"])
        self.models = ModelMap(str(values["kv-events-models"]))
        self.vllm_glob = str(values["kv-events-vllm-namespaces"]).encode()
        self._vllm: dict[str, bool] = {}
        try:
            self.topic_template.format(node="", model="")
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(
                f"invalid value for 'kv-events-topic': {exc!r} (placeholders: {{node}}, {{model}})"
            ) from None
        #: the newest messages (seq, topic, payload), at most ``kv-events-buffer`` bytes
        self.buffer: deque[tuple[int, bytes, bytes]] = deque()
        self.buffer_cap = int(values["kv-events-buffer"])
        self.buffer_bytes = 0
        self.counters = Counters()
        self.seq = 0
        self._encode = msgspec.msgpack.Encoder().encode
        self._topics: dict[str, bytes] = {}
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, values["kv-events-hwm"])
        self._pub.setsockopt(zmq.XPUB_NODROP, 1)  # full queue: EAGAIN (counted), not silence
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- life cycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Bind (or, for ``>tcp://…``, connect) the PUB socket and bind the replay socket."""
        zmq = self._zmq
        try:
            _attach(self._pub, self.endpoint)
            if self.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, REPLAY_HWM)
                self._replay.setsockopt(zmq.LINGER, 0)
                _attach(self._replay, self.replay_endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ConfigError(f"invalid value for 'kv-events-endpoint': {exc}") from None
        if self._replay is not None:
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._replay.getsockopt(zmq.FD), self._serve_replay)
        log.info("KV events on %s (replay %s)", self.endpoint, self.replay_endpoint or "off")

    def close(self) -> None:
        if self._loop is not None and self._replay is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._replay.getsockopt(self._zmq.FD))
        self._loop = None
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._replay = None
        self._ctx.term()

    # -- the sink ---------------------------------------------------------------------------

    def send(self, events: list[Event]) -> None:
        """One flush's events: runs of one namespace become messages on its topic. A failure
        is counted and logged (``kv_events_errors``); the events of later flushes still go."""
        try:
            self._send(events)
        except Exception:
            self.counters.errors += 1
            log.exception("encoding KV events failed; %d events lost", len(events))

    def _send(self, events: list[Event]) -> None:
        run: list[Any] = []
        run_ns: str | None = None
        for event in events:
            if event[0] == CLEARED:
                self._flush(run_ns, run)
                run, run_ns = [], None
                self._cleared()
                continue
            ns = event[1]
            if ns != run_ns or len(run) >= MAX_EVENTS:
                self._flush(run_ns, run)
                run, run_ns = [], ns
            run.append(self._wire(event))
        self._flush(run_ns, run)

    def _wire(self, event: Event) -> Any:
        out = self._wire_map(event)
        if not self.arrays:
            return out
        # array_like events of vLLM before 0.11 (and llm-d's decoder): the fields in order
        keys: tuple[str, ...]
        if out["type"] == "BlockStored":
            keys = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium")  # fmt: skip
        else:
            keys = ("block_hashes", "medium")
        return [out["type"], *(out[k] for k in keys)]

    def _wire_map(self, event: Event) -> dict[str, Any]:
        ns, digest = event[1], event[2]
        offload_key = self._is_vllm(ns) and len(digest) > 4
        if offload_key:  # vLLM's OffloadKey: block hash, then the group index (4 bytes, BE)
            digest, group = digest[:-4], int.from_bytes(digest[-4:], "big")
        if event[0] == STORED:
            _, _, _, parent, block_size, medium, ids = event
            if offload_key and len(parent) > 4:
                parent = parent[:-4]
            _model, lora_id, lora_name = self.models.lookup(ns)
            out = {
                "type": "BlockStored",
                "block_hashes": [wire_hash(digest, self.hash_format)],
                "parent_block_hash": wire_hash(parent, self.hash_format) if parent else None,
                "token_ids": _token_list(ids) if ids else [],
                "block_size": block_size,
                "lora_id": lora_id,
                "medium": medium,
                "lora_name": lora_name,
            }
        else:
            assert event[0] == REMOVED
            out = {
                "type": "BlockRemoved",
                "block_hashes": [wire_hash(digest, self.hash_format)],
                "medium": event[3],
            }
        if offload_key:
            out["group_idx"] = group
        return out

    def _is_vllm(self, ns: str) -> bool:
        found = self._vllm.get(ns)
        if found is None:
            found = bool(self.vllm_glob) and glob_match(self.vllm_glob, ns.encode())
            if len(self._vllm) < 4096:
                self._vllm[ns] = found
        return found

    def _cleared(self) -> None:
        """AllBlocksCleared on every topic used so far (the node's own one before any)."""
        topics = list(self._topics.values()) or [self._topic_of("")]
        event: Any = ["AllBlocksCleared"] if self.arrays else {"type": "AllBlocksCleared"}
        for topic in topics:
            self._publish(topic, [event])

    def _flush(self, ns: str | None, run: list[Any]) -> None:
        if run and ns is not None:
            self._publish(self._topic_of(ns), run)

    def _topic_of(self, ns: str) -> bytes:
        topic = self._topics.get(ns)
        if topic is None:
            model = self.models.lookup(ns)[0] if ns else ""
            topic = self.topic_template.format(node=self.node, model=model).encode()
            if ns:
                self._topics[ns] = topic
        return topic

    def _publish(self, topic: bytes, events: list[Any]) -> None:
        payload = self._encode([time.time(), events, 0])
        seq = self.seq
        self.seq += 1
        self._keep(seq, topic, payload)
        counters = self.counters
        try:
            self._pub.send_multipart(
                (topic, seq.to_bytes(8, "big"), payload), flags=self._zmq.NOBLOCK
            )
        except self._zmq.Again:
            counters.dropped_messages += 1
            counters.dropped_events += len(events)
            return
        except self._zmq.ZMQError as exc:
            counters.errors += 1
            counters.dropped_messages += 1
            counters.dropped_events += len(events)
            log.warning("publishing KV events failed: %s", exc)
            return
        counters.messages += 1
        counters.events += len(events)

    def _keep(self, seq: int, topic: bytes, payload: bytes) -> None:
        self.buffer.append((seq, topic, payload))
        self.buffer_bytes += len(payload) + len(topic)
        while self.buffer_bytes > self.buffer_cap and len(self.buffer) > 1:
            _, old_topic, old = self.buffer.popleft()
            self.buffer_bytes -= len(old) + len(old_topic)

    # -- replay -----------------------------------------------------------------------------

    def _serve_replay(self) -> None:
        """Answer every waiting replay request (ZMQ's FD is edge triggered: drain it)."""
        zmq = self._zmq
        sock = self._replay
        while sock is not None and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                self.counters.errors += 1
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            self.counters.replay_requests += 1
            try:
                for seq, topic, payload in list(self.buffer):
                    if seq >= start:
                        sock.send_multipart(
                            (ident, b"", topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK
                        )
                        self.counters.replayed_messages += 1
                sock.send_multipart((ident, b"", b"", END_SEQ, b""), zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # that requester's queue is full: it asks again
                self.counters.errors += 1
                log.warning("answering a KV event replay request failed: %s", exc)

    def info(self) -> list[tuple[str, object]]:
        c = self.counters
        return [
            ("kv_events_endpoint", self.endpoint),
            ("kv_events_replay_endpoint", self.replay_endpoint),
            ("kv_events_node", self.node),
            ("kv_events_next_seq", self.seq),
            ("kv_events_messages", c.messages),
            ("kv_events_sent", c.events),
            ("kv_events_dropped_messages", c.dropped_messages),
            ("kv_events_dropped", c.dropped_events),
            ("kv_events_replay_requests", c.replay_requests),
            ("kv_events_replayed_messages", c.replayed_messages),
            ("kv_events_buffered_messages", len(self.buffer)),
            ("kv_events_buffered_bytes", self.buffer_bytes),
            ("kv_events_errors", c.errors),
        ]


def _attach(sock: Any, endpoint: str) -> None:
    """``>tcp://host:port`` connects (to a subscriber that binds, as llm-d's indexer does);
    anything else (``tcp://127.0.0.1:5557``, ``tcp://*:5557``, ``ipc://…``) binds."""
    if endpoint.startswith(">"):
        sock.connect(endpoint[1:])
    else:
        sock.bind(endpoint.removeprefix("@"))
