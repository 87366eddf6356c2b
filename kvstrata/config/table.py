"""The key table: every configuration key with its default, parser, documentation and whether
``CONFIG SET`` may change it at run time (:data:`OPTIONS`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstrata.buffer_limits import BufferLimits, parse_buffer_limits
from kvstrata.config.values import (
    Share,
    _auth_key,
    _bind,
    _bool,
    _choice,
    _float,
    _format_share_or_size,
    _int,
    _path,
    _ratio,
    _redacted,
    _share_or_size,
    _size_at_most,
    _str,
    _yes_no,
    format_size,
    parse_size,
)


@dataclass(frozen=True, slots=True)
class Option:
    name: str  # dashed
    default: Any
    parse: Callable[[Any], Any]
    doc: str
    mutable: bool = False  # CONFIG SET allowed at run time
    secret: bool = False
    fmt: Callable[[Any], str] = str

    @property
    def env(self) -> str:
        """The environment variable: ``KVSTRATA_DRAM_CAPACITY``."""
        return "KVSTRATA_" + self.name.upper().replace("-", "_")


def _opt(name: str, default: Any, parse: Callable[[Any], Any], doc: str, **kw: Any) -> Option:
    return Option(name, default, parse, doc, **kw)


_SIZE = {"fmt": format_size}
OPTIONS: tuple[Option, ...] = (
    # network and security
    _opt("bind", "127.0.0.1", _bind, "Addresses to listen on, space separated."),
    _opt("port", 7379, _int(0, 65535, "PORT"),
         "TCP port (0 picks a free one; the log says which)."),
    _opt("requirepass", "", _str, "Password for AUTH; empty disables it.", mutable=True,
         secret=True),
    _opt("protected-mode", True, _bool,
         "Without a password, refuse clients that are not on loopback.", mutable=True,
         fmt=_yes_no),
    _opt("maxclients", 10000, _int(1, 1_000_000), "Most clients connected at once.",
         mutable=True),
    _opt("timeout", 0, _int(0, 10**9, "SECONDS"),
         "Close clients idle this many seconds (0 = never).", mutable=True),
    _opt("tls-port", 0, _int(0, 65535, "PORT"), "TLS port (0 = no TLS listener)."),
    _opt("tls-cert-file", "", _path, "Server certificate (PEM)."),
    _opt("tls-key-file", "", _path, "Server private key (PEM)."),
    _opt("tls-ca-cert-file", "", _path, "CA bundle to verify clients with."),
    _opt("tls-auth-clients", "no", _choice("yes", "no", "optional"),
         "Require client certificates."),
    # limits
    _opt("proto-max-bulk-len", 1024**3, parse_size, "Largest bulk argument (bytes).",
         mutable=True),
    _opt("max-multibulk-len", 1024 * 1024, _int(1, 2**31 - 1), "Most arguments in a command.",
         mutable=True),
    _opt("client-query-buffer-limit", 1024**3, parse_size,
         "Most bytes of unexecuted commands buffered per client.", mutable=True),
    _opt("maxmemory", 0, parse_size,
         "Most bytes plain string values (SET) may count: a small value (< 64 KiB) counts key "
         "+ value + 64, a large one key + 64 (its bytes live in the tiers, which bound them); "
         "0 = dram-capacity.", mutable=True, **_SIZE),
    _opt("maxmemory-policy", "allkeys-lru",
         _choice("allkeys-lru", "allkeys-random", "volatile-lru", "volatile-random",
                 "volatile-ttl", "noeviction"),
         "Which string keys a write over maxmemory evicts (Redis's policies); noeviction "
         "answers -OOM.", mutable=True),
    _opt("write-wait-queue", 4096, _int(1, 10**6),
         "Most writes (KV.PUT, KV.RESERVE/MRESERVE, promotions for KV.LEASE) waiting in turn "
         "for DRAM room; more get -OOM.", mutable=True),
    _opt("write-wait-timeout", 30000, _int(1, 3_600_000, "MS"),
         "Most ms a write waits in turn for DRAM room before -OOM.", mutable=True),
    _opt("client-output-buffer-limit", BufferLimits(), parse_buffer_limits,
         "Redis's `<class> <hard> <soft> <soft seconds>`, repeated, for classes normal, "
         "monitor, replica, pubsub: a client whose unsent replies reach the hard limit, or stay "
         "above the soft limit longer than the soft seconds, is disconnected and its pinned "
         "chunks released (0 = no limit). Setting some classes keeps the others.",
         mutable=True),
    _opt("payload-timeout", 30, _int(0, 86_400, "SECONDS"),
         "Seconds a half-received command (a payload being uploaded) may make no progress "
         "before its connection is closed and its DRAM slot freed (0 = never).", mutable=True),
    _opt("loopback-sndbuf", 128 * 1024, parse_size,
         "Send buffer (SO_SNDBUF, which Linux doubles) of connections from loopback clients: a "
         "small one keeps the bytes of a large reply in the CPU cache between the server's copy "
         "and the client's (0 = the kernel's autotuning). Remote clients always get the "
         "kernel's autotuning, which covers the bandwidth-delay product. New connections.",
         mutable=True, **_SIZE),
    _opt("max-chain-chunks", 65536, _int(1, 2**31 - 1),
         "Most chunks (hashes) one KV.MATCH/MGET/LEASE/MRESERVE/PREFETCH names or one "
         "KV.MATCHTOKENS produces.", mutable=True),
    _opt("max-match-tokens", 16 * 1024 * 1024, _int(1, 2**31 - 1),
         "Most token ids in one KV.MATCHTOKENS.", mutable=True),
    _opt("min-chunk-tokens", 16, _int(1, 1 << 20),
         "Smallest CHUNK a KV.MATCHTOKENS may ask for.", mutable=True),
    _opt("shutdown-timeout", 10, _int(0, 3600, "SECONDS"),
         "Seconds in-flight commands get to finish on shutdown.", mutable=True),
    _opt("slowlog-log-slower-than", 10000, _int(-1, 10**12, "MICROS"),
         "Microseconds above which a command is logged (-1 disables).", mutable=True),
    _opt("slowlog-max-len", 128, _int(0, 10**6), "Slow log entries kept.", mutable=True),
    _opt("fast-path", True, _bool,
         "Run PING, ECHO, GET, SET key value, EXISTS, and KV.MATCH / KV.MGET of chunks the "
         "index holds, on the compiled small-command path when it is built (no: every command "
         "on the Python path; same replies, more CPU).",
         mutable=True, fmt=_yes_no),
    _opt("metrics-port", 0, _int(0, 65535, "PORT"),
         "Port of the Prometheus /metrics endpoint, on the first bind address (0 = off; needs "
         "the metrics extra)."),
    # process
    _opt("loglevel", "notice", _choice("debug", "verbose", "notice", "warning"),
         "Log level.", mutable=True),
    _opt("data-dir", "./kvstrata-data", _path, "Folder for persistent tiers."),
    _opt("trace-file", "", _path, "Append every KV.MATCH/PUT/GET/LEASE/SESSION/PREFETCH (sizes "
         "and hashes, no payloads) to this JSON Lines file for kvstrata simulate; empty = off."),
    # KV events (docs/events.md)
    _opt("kv-events-endpoint", "", _str,
         "ZMQ PUB endpoint of the KV events routers read (vLLM's wire format), e.g. "
         "tcp://127.0.0.1:5557; >tcp://host:port connects instead of binding; empty = off "
         "(needs the events extra)."),
    _opt("kv-events-replay-endpoint", "", _str,
         "ZMQ ROUTER endpoint where a subscriber that missed sequence numbers asks for them "
         "again (vLLM's replay protocol); empty = off."),
    _opt("kv-events-buffer", 64 * 1024**2, parse_size,
         "Bytes of the newest messages kept for replay (a message: one namespace's events of a "
         "millisecond, at most 256).", **_SIZE),
    _opt("kv-events-hwm", 256, _int(1, 10**7),
         "Messages queued per subscriber (ZMQ high-water mark); past it a message is dropped "
         "for every subscriber (INFO events: kv_events_dropped) and stays in the replay buffer, "
         "never waited for."),
    _opt("kv-events-topic", "kv@{node}@{model}", _str,
         "Topic frame of each message; {node} is kv-events-node, {model} the namespace's "
         "model (kv-events-models)."),
    _opt("kv-events-node", "", _str,
         "This node's name in topics and in KV.TIERMATCH replies (empty = hostname:port)."),
    _opt("kv-events-models", "", _str,
         "Namespace → model and LoRA in the events: space-separated "
         "NAMESPACE-GLOB=MODEL[;LORA_ID[;LORA_NAME]], first match wins; other namespaces: "
         "their text up to the first @."),
    _opt("kv-events-vllm-namespaces", "vllm:*", _str,
         "Namespace glob of the vLLM tier (clients/vllm.py): its hashes are vLLM offload keys "
         "(block hash + 4-byte group), sent as vLLM's block hash and group_idx."),
    _opt("kv-events-event-format", "map", _choice("map", "array"),
         "map = vLLM 0.33's events (maps tagged by type); array = the array_like events of "
         "earlier vLLM releases, which llm-d's kv-cache-manager decodes ([tag, hashes, parent, "
         "token_ids, block_size, lora_id, medium])."),
    _opt("kv-events-hash-format", "int64", _choice("int64", "bytes"),
         "Block hashes in the events: int64 = the hash as a big-endian integer, low 64 bits "
         "(vLLM's default conversion of its own block hashes); bytes = as stored."),
    # KV store
    _opt("chunk-tokens", 256, _int(1, 1 << 20), "Default tokens per chunk (KV.MATCHTOKENS)."),
    _opt("lease-ttl", 30000, _int(1, 86_400_000, "MS"), "Default lease lifetime in ms.",
         mutable=True),
    _opt("lease-max", 65536, _int(0, 10**8),
         "Most leases held at once by all clients (0 = no limit); past it -LEASELIMIT.",
         mutable=True),
    _opt("lease-max-per-client", 4096, _int(0, 10**8),
         "Most leases one connection holds at once (0 = no limit); past it -LEASELIMIT.",
         mutable=True),
    _opt("lease-fence-max", 256 * 1024**2, parse_size,
         "Most bytes one connection keeps out of reuse through leases that expired while it "
         "was connected; past it its new leases get -LEASELIMIT (0 = no limit).",
         mutable=True, **_SIZE),
    _opt("lease-reserve-max-per-client", Share(50), _share_or_size,
         "Most bytes of live write-lease slots (KV.RESERVE, KV.MRESERVE, counted in 4 KiB "
         "allocation units) one connection holds at once, as a size or a percentage of "
         "dram-capacity (0 = no limit); past it -LEASELIMIT.", mutable=True,
         fmt=_format_share_or_size),
    _opt("write-lease-ttl-max", 60000, _int(0, 86_400_000, "MS"),
         "Longest TTL in ms of a write lease (KV.RESERVE, KV.MRESERVE): a longer TTL gets "
         "-LEASELIMIT and a default lease-ttl above it is cut to it (0 = no cap).",
         mutable=True),
    _opt("reply-pin-max", 32 * 1024**2, parse_size,
         "Most bytes of DRAM one connection's unsent zero-copy replies (KV.GET, KV.MGET, GET of "
         "large values) may pin longer than reply-pin-timeout: past it their bytes not yet "
         "handed to the socket are copied out of the arena, and a client whose socket alone "
         "still pins more after another reply-pin-timeout is closed. Half of it is what a "
         "connection hands to its socket at once (0 = no bound).", mutable=True, **_SIZE),
    _opt("reply-pin-timeout", 5, _int(1, 3600, "SECONDS"),
         "Seconds a connection's unsent replies may pin more than reply-pin-max of DRAM.",
         mutable=True),
    _opt("dram-capacity", 1024**3, parse_size, "Size of the shared-memory DRAM arena.", **_SIZE),
    _opt("dram-high-watermark", 0.95, _ratio, "Demote from DRAM above this fill ratio.",
         mutable=True),
    _opt("dram-low-watermark", 0.85, _ratio, "…down to this fill ratio.", mutable=True),
    _opt("dram-pin", "auto", _choice("auto", "yes", "no"),
         "Register the arena with cudaHostRegister when CUDA exists."),
    _opt("dram-pin-quota", 0, parse_size, "Most bytes to pin (0 = the whole arena).", **_SIZE),
    _opt("nvme-path", "", _path, "Folder of the NVMe tier (default: DATA-DIR/nvme)."),
    _opt("nvme-capacity", 16 * 1024**3, parse_size, "NVMe tier size (0 disables the tier).",
         **_SIZE),
    _opt("nvme-write-policy", "write-back", _choice("write-back", "write-through"),
         "write-through: every PUT is on disk before it is acknowledged.", mutable=True),
    _opt("nvme-backend", "auto", _choice("auto", "posix", "kvikio"),
         "I/O backend: kvikio (GPUDirect Storage) when CUDA works, POSIX otherwise."),
    _opt("nvme-io-threads", 4, _int(1, 256), "Threads doing NVMe I/O."),
    _opt("nvme-fsync", "batch", _choice("always", "batch", "never"),
         "When an NVMe write is acknowledged: always (fsync file + folder), batch (group "
         "commit, ext4/xfs), never (survives kill -9, not power loss)."),
    _opt("nvme-slab-max", 1024**2, _size_at_most(4 * 1024**2),
         "NVMe chunks up to this size are packed into slots of preallocated slab files, larger "
         "ones get a file each (0: every chunk a file; at most 4MiB).", **_SIZE),
    _opt("nvme-high-watermark", 0.95, _ratio, "Evict from NVMe above this fill ratio.",
         mutable=True),
    _opt("nvme-low-watermark", 0.85, _ratio, "…down to this fill ratio.", mutable=True),
    _opt("s3-bucket", "", _str, "S3 bucket; empty = no S3 tier."),
    _opt("s3-endpoint", "", _str, "S3 endpoint URL (MinIO, Ceph…); empty = AWS."),
    _opt("s3-region", "us-east-1", _str, "S3 region."),
    _opt("s3-prefix", "kvstrata", _str, "Key prefix inside the bucket."),
    _opt("s3-write-policy", "write-back", _choice("write-back", "write-through"),
         "write-through: PUTs are uploaded at once so other nodes see them.", mutable=True),
    _opt("s3-max-connections", 16, _int(1, 1024), "Parallel S3 requests."),
    _opt("s3-timeout", 10.0, _float(0.1, 3600.0, "SECONDS"),
         "Seconds per S3 request before it counts as failed."),
    _opt("s3-auth-key", "", _auth_key, "Key of the HMAC-SHA256 tags on S3 objects (16+ "
         "characters; empty: no tags). Objects without a valid tag are misses; shown redacted.",
         secret=True, fmt=_redacted),
    _opt("s3-codec", "none", _choice("none", "bf16x", "fp16x", "int4e", "auto"),
         "Lossless codec applied to chunks as they are uploaded to S3 and undone when they "
         "are read back (KV.GET returns what was put): bf16x/fp16x split 16-bit values and "
         "entropy-code the exponents, int4e entropy-codes KVST int4 payloads, auto picks by "
         "a KVST payload's header (bf16x for other bytes). Kept only when it saves 3%."),
    _opt("s3-max-remote-records", 1_000_000, _int(0, 10**9), "Most index records of chunks "
         "held only in S3 (least recently used are forgotten, the objects stay; 0: no bound)."),
    _opt("gpu-device", 0, _int(0, 64), "CUDA device of the GPU tier."),
    _opt("gpu-capacity", 0, parse_size, "GPU pool size (0 disables the GPU tier).", **_SIZE),
    _opt("gpu-high-watermark", 0.95, _ratio, "Demote from the GPU pool to DRAM above this fill "
         "ratio.", mutable=True),
    _opt("gpu-low-watermark", 0.85, _ratio, "…down to this fill ratio.", mutable=True),
    _opt("gpu-copy-threads", 2, _int(1, 64),
         "Concurrent host<->GPU copies (one CUDA stream each)."),
    _opt("prefetch-queue", 1024, _int(1, 10**6), "Most queued prefetch requests."),
    _opt("prefetch-concurrency", 4, _int(1, 256), "Chunks promoted at once by prefetch."),
    _opt("prefetch-bandwidth", 0, parse_size, "Prefetch byte budget per second (0 = no cap).",
         mutable=True, **_SIZE),
)  # fmt: skip
_BY_NAME = {o.name: o for o in OPTIONS}


def option_names() -> list[str]:
    return [o.name for o in OPTIONS]


def option(name: str) -> Option | None:
    return _BY_NAME.get(name)
