"""One typed configuration from a TOML file, ``KVSTRATA_*`` environment variables and flags.

Precedence: command-line flags > environment > TOML file > defaults. Every key has a Redis-style
dashed name (``dram-capacity``) used by ``CONFIG GET/SET``, TOML (dashes or underscores), the
flag (``--dram-capacity``) and the environment (``KVSTRATA_DRAM_CAPACITY``). A bad value raises
:class:`ConfigError` naming the key and what is wrong. ``docs/configuration.md`` is generated
from :data:`OPTIONS` (``python -m kvstrata.config``).
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvstrata.buffer_limits import BufferLimits, parse_buffer_limits

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024, "ki": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2, "mi": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "gi": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4, "ti": 1024**4,
}  # fmt: skip


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key."""


_SIZE_HINT = 'write a size such as 0, 65536, "512MiB" or "4GiB"'


def _refuse_bool(value: object, what: str, hint: str) -> None:
    """TOML's ``true``/``false`` are ints to Python (``int(True) == 1``): without this a
    ``nvme-capacity = true`` ran with a 1-byte tier. No size, count or duration is a boolean."""
    if isinstance(value, bool):
        raise ValueError(f"{str(value).lower()} is a boolean, not {what}: {hint}")


def parse_size(text: str | int) -> int:
    """``4GiB`` → 4294967296; ``512mb`` → 512000000 (Redis: mb is 1024², we follow SI/IEC)."""
    _refuse_bool(text, "a size", _SIZE_HINT)
    if isinstance(text, int):
        if text < 0:
            raise ValueError("must not be negative")
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size (examples: 0, 65536, 512MiB, 4GiB)")
    number, unit = m.group(1), (m.group(2) or "").lower()
    if unit not in _UNITS:
        raise ValueError(f"unknown unit in {text!r} (use B, KiB, MiB, GiB, TiB, KB, MB, GB)")
    return int(float(number) * _UNITS[unit])


def format_size(n: int) -> str:
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _yes_no(value: Any) -> str:
    return "yes" if value else "no"


#: what ``serve --help`` shows for the values of each parser (``_choice`` lists its choices);
#: the factories below add their closures with the unit they were given
METAVARS: dict[Callable[[Any], Any], str] = {}


def _typed(parse: Callable[[Any], Any], metavar: str) -> Any:
    """Record ``parse``'s metavar (SIZE, MS, SECONDS…) and return it."""
    METAVARS[parse] = metavar
    return parse


def _float(lo: float, hi: float, unit: str = "NUMBER") -> Callable[[Any], float]:
    def parse(text: Any) -> float:
        _refuse_bool(text, "a number", f"write a number from {lo} to {hi}")
        try:
            value = float(text)
        except (TypeError, ValueError):
            raise ValueError(f"{text!r} is not a number") from None
        if not lo <= value <= hi:  # also refuses nan
            raise ValueError(f"{value} is out of range [{lo}, {hi}]")
        return value

    return _typed(parse, unit)


LOG_LEVELS = {"debug": 10, "verbose": 20, "notice": 20, "warning": 30}


def apply_loglevel(level: str) -> None:
    """Make a (new) loglevel take effect on kvstrata's loggers."""
    import logging

    logging.getLogger("kvstrata").setLevel(LOG_LEVELS[level])


def _bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    low = str(text).strip().lower()
    if low in ("yes", "true", "on", "1"):
        return True
    if low in ("no", "false", "off", "0"):
        return False
    raise ValueError(f"{text!r} is not a boolean (yes/no)")


def _int(lo: int, hi: int, unit: str = "N") -> Callable[[Any], int]:
    """Integers in ``[lo, hi]``; ``unit`` (N, MS, SECONDS, MICROS, PORT) is the metavar."""

    def parse(text: Any) -> int:
        _refuse_bool(text, "an integer", f"write an integer from {lo} to {hi}")
        if isinstance(text, float) and not text.is_integer():  # TOML 2.5, inf, nan
            raise ValueError(f"{text!r} is not an integer (write one from {lo} to {hi})")
        try:
            value = int(text)
        except (TypeError, ValueError):
            raise ValueError(f"{text!r} is not an integer") from None
        if not lo <= value <= hi:
            raise ValueError(f"{value} is out of range [{lo}, {hi}]")
        return value

    return _typed(parse, unit)


def _ratio(text: Any) -> float:
    _refuse_bool(text, "a ratio", "write a number above 0 and at most 1, such as 0.9")
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{text!r} is not a number") from None
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{value} must be in (0, 1]")
    return value


def _choice(*choices: str) -> Callable[[Any], str]:
    def parse(text: Any) -> str:
        value = str(text).strip().lower()
        if value not in choices:
            raise ValueError(f"{text!r} is not one of {', '.join(choices)}")
        return value

    parse.choices = choices  # type: ignore[attr-defined]  # shown by --help
    return parse


def _str(text: Any) -> str:
    _refuse_bool(text, "text", 'write it in quotes ("...")')
    return str(text)


def _path(text: Any) -> str:
    """A file or folder name (shown as PATH by ``--help``)."""
    return _str(text)


def _auth_key(text: Any) -> str:
    key = str(text)
    if key and len(key) < 16:
        raise ValueError("must be empty or at least 16 characters")  # never echo the key
    return key


def _redacted(value: Any) -> str:
    return "(redacted)" if value else ""


def _bind(text: Any) -> str:
    parts = str(text).split()
    if not parts:
        raise ValueError("needs at least one address")
    for part in parts:
        host = part.lstrip("-")
        if host in ("localhost", "*"):
            continue
        try:
            ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            raise ValueError(f"{part!r} is not an IP address") from None
    return " ".join(parts)


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


@dataclass(frozen=True, slots=True)
class Share:
    """A bound given as a percentage of the DRAM arena (``50%``) instead of a size."""

    percent: float

    def of(self, capacity: int) -> int:
        return int(capacity * self.percent / 100)

    def __str__(self) -> str:
        return f"{self.percent:g}%"


def share_or_size(value: Any, capacity: int) -> int:
    """The bytes a :func:`_share_or_size` value stands for in an arena of ``capacity``."""
    return value.of(capacity) if isinstance(value, Share) else int(value)


def _share_or_size(text: Any) -> Share | int:
    """``50%`` (of the DRAM arena) or a size."""
    if isinstance(text, Share):
        return text
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a size or a percentage")
    raw = str(text).strip()
    if raw.endswith("%"):
        try:
            percent = float(raw[:-1])
        except ValueError:
            raise ValueError(f"{text!r} is not a percentage") from None
        if not 0 < percent <= 100:  # also refuses nan
            raise ValueError(f"{text!r} must be above 0% and at most 100%")
        return Share(percent)
    return parse_size(text)


def _format_share_or_size(value: Any) -> str:
    return str(value) if isinstance(value, Share) else format_size(value)


def _size_at_most(limit: int) -> Callable[[Any], int]:
    def parse(text: Any) -> int:
        n = parse_size(text)
        if n > limit:
            raise ValueError(f"must be at most {format_size(limit)}")
        return n

    return _typed(parse, "SIZE")


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
         "Run PING, ECHO, GET, SET key value and EXISTS on the compiled small-command path when "
         "it is built (no: every command on the Python path; same replies, more CPU).",
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
METAVARS.update({
    parse_size: "SIZE", _bool: "yes|no", _ratio: "RATIO", _bind: "ADDR", _path: "PATH",
    _str: "TEXT", _auth_key: "KEY", _share_or_size: "SIZE|PERCENT",
    parse_buffer_limits: "LIMITS",
})  # fmt: skip

#: The groups of ``serve --help`` and docs/configuration.md, in order, as redis.conf's sections;
#: a name ending in ``*`` takes every key with that prefix. Every key is in exactly one group
#: (tests/test_config_help.py); a key in none is listed under "other" meanwhile.
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("network", ("bind", "port", "timeout", "loopback-sndbuf")),
    ("tls", ("tls-*",)),
    ("security", ("requirepass", "protected-mode")),
    ("general", ("loglevel", "data-dir", "shutdown-timeout", "fast-path")),
    ("clients and limits", ("maxclients", "proto-max-bulk-len", "max-multibulk-len",
                            "client-query-buffer-limit", "client-output-buffer-limit",
                            "payload-timeout")),
    ("memory management", ("maxmemory", "maxmemory-policy", "write-wait-queue",
                           "write-wait-timeout")),
    ("kv store", ("chunk-tokens", "min-chunk-tokens", "max-chain-chunks", "max-match-tokens")),
    ("leases and reply pins", ("lease-*", "write-lease-ttl-max", "reply-pin-*")),
    ("dram tier", ("dram-*",)),
    ("nvme tier", ("nvme-*",)),
    ("s3 tier", ("s3-*",)),
    ("gpu tier", ("gpu-*",)),
    ("prefetch", ("prefetch-*",)),
    ("slow log", ("slowlog-*",)),
    ("metrics", ("metrics-port",)),
    ("kv events for routers", ("kv-events-*",)),
    ("tracing", ("trace-file",)),
)  # fmt: skip


def _in_group(name: str, patterns: tuple[str, ...]) -> bool:
    return any(name.startswith(p[:-1]) if p.endswith("*") else name == p for p in patterns)


def grouped_options() -> list[tuple[str, list[Option]]]:
    """(group title, its keys in table order) for every group of :data:`GROUPS` (a key goes to
    the first group that names it) and "other" for keys no group names, when there are any."""
    groups: list[tuple[str, list[Option]]] = [(title, []) for title, _ in GROUPS]
    other: list[Option] = []
    for opt in OPTIONS:
        index = next((i for i, (_, pats) in enumerate(GROUPS) if _in_group(opt.name, pats)), -1)
        (groups[index][1] if index >= 0 else other).append(opt)
    return groups + ([("other", other)] if other else [])


def groups_of(name: str) -> list[str]:
    """Every group title whose patterns take ``name`` (exactly one for each key)."""
    return [title for title, patterns in GROUPS if _in_group(name, patterns)]


def metavar(opt: Option) -> str:
    """What ``serve --help`` shows for the key's value, from its parser: ``{a,b}``, ``SIZE``,
    ``MS``, ``SECONDS``, ``yes|no``, ``N``…"""
    choices = getattr(opt.parse, "choices", None)
    if choices:
        return "{" + ",".join(choices) + "}"
    return METAVARS.get(opt.parse, "TEXT")


@dataclass(slots=True)
class Config:
    """Resolved settings; attribute names are the dashed names with underscores."""

    values: dict[str, Any]

    def __getattr__(self, attr: str) -> Any:
        try:
            return self.values[attr.replace("_", "-")]
        except KeyError:
            raise AttributeError(attr) from None

    def get(self, name: str) -> Any:
        return self.values[name]

    def set(self, name: str, raw: Any, check: bool = True) -> None:
        """Validate and set (CONFIG SET); raises ConfigError. With ``check=False`` the rules
        across keys are left to a later :meth:`check` (a CONFIG SET of several keys)."""
        opt = _BY_NAME.get(name)
        if opt is None:
            raise ConfigError(f"Unknown option or number of arguments for CONFIG SET - '{name}'")
        if not opt.mutable:
            raise ConfigError(
                f"CONFIG SET failed (possibly related to argument '{name}') - "
                "can't set immutable config"
            )
        self.values[name] = _merge(self.values.get(name), _parse(opt, raw))
        if check:
            _check(self.values)

    def check(self) -> None:
        """Rules across keys (low watermarks below high ones, TLS files with a TLS port)."""
        _check(self.values)

    def render(self, name: str) -> str:
        """The value as CONFIG GET prints it."""
        return _BY_NAME[name].fmt(self.values[name]) if name in _BY_NAME else ""

    def items(self) -> list[tuple[str, str]]:
        return [(o.name, o.fmt(self.values[o.name])) for o in OPTIONS]

    @property
    def nvme_dir(self) -> Path:
        return Path(self.values["nvme-path"] or Path(self.values["data-dir"]) / "nvme")

    @property
    def binds(self) -> list[str]:
        return str(self.values["bind"]).split()


def _parse(opt: Option, raw: Any) -> Any:
    try:
        return opt.parse(raw)
    except ValueError as exc:
        raise ConfigError(f"invalid value for '{opt.name}': {exc}") from None


def _merge(old: Any, new: Any) -> Any:
    """A value that names only part of a key (some classes of client-output-buffer-limit)
    keeps the rest of the old one."""
    if isinstance(new, BufferLimits) and isinstance(old, BufferLimits):
        return new.merged_into(old)
    return new


def _check(values: Mapping[str, Any]) -> None:
    for tier in ("gpu", "dram", "nvme"):
        lo, hi = values[f"{tier}-low-watermark"], values[f"{tier}-high-watermark"]
        if lo > hi:
            raise ConfigError(
                f"invalid value for '{tier}-low-watermark': {lo} is above "
                f"{tier}-high-watermark ({hi})"
            )
    if values["chunk-tokens"] < values["min-chunk-tokens"]:
        raise ConfigError(
            f"invalid value for 'min-chunk-tokens': {values['min-chunk-tokens']} is above "
            f"chunk-tokens ({values['chunk-tokens']})"
        )
    if values["kv-events-replay-endpoint"] and not values["kv-events-endpoint"]:
        raise ConfigError("invalid value for 'kv-events-replay-endpoint': needs kv-events-endpoint")
    if values["tls-port"] and not (values["tls-cert-file"] and values["tls-key-file"]):
        raise ConfigError("invalid value for 'tls-port': needs tls-cert-file and tls-key-file")
    if values["tls-port"] and values["tls-auth-clients"] != "no" and not values["tls-ca-cert-file"]:
        # Redis refuses this too: no client certificate could ever be verified
        raise ConfigError(
            f"invalid value for 'tls-auth-clients': {values['tls-auth-clients']} needs "
            "tls-ca-cert-file (the CA that signs client certificates)"
        )


def load_config(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | Path | None = None,
) -> Config:
    """Resolve defaults < TOML file < environment < flags. Keys in ``flags`` are dashed."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {o.name: o.default for o in OPTIONS}
    layers: list[tuple[str, Mapping[str, Any]]] = []
    if config_file:
        path = Path(config_file)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        layers.append((f"{path}", {k.replace("_", "-"): v for k, v in data.items()}))
    prefix = "KVSTRATA_"
    layers.append(("environment", {
        k[len(prefix):].lower().replace("_", "-"): v for k, v in env.items()
        if k.startswith(prefix) and k not in ("KVSTRATA_CONFIG",)
    }))  # fmt: skip
    layers.append(("command line", dict(flags or {})))
    for source, layer in layers:
        for name, raw in layer.items():
            if raw is None:
                continue
            opt = _BY_NAME.get(name)
            if opt is None:
                if source == "environment":
                    continue  # foreign KVSTRATA_* variables are not ours to judge
                close = difflib.get_close_matches(name, list(_BY_NAME), n=1, cutoff=0.6)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise ConfigError(f"unknown key '{name}' in {source}{hint}")
            values[name] = _merge(values[name], _parse(opt, raw))
    _check(values)
    _check_dram_floor(values)
    return Config(values)


#: KV bytes per token the smallest DRAM arena must hold for one chunk of ``min-chunk-tokens``
#: (64 KiB: fp16 KV of a 1–3B model; a 7B-class model's is 128–512 KiB)
FLOOR_BYTES_PER_TOKEN = 64 * 1024


def dram_floor(min_chunk_tokens: int) -> int:
    """The smallest ``dram-capacity`` accepted: one chunk of ``min-chunk-tokens`` tokens at
    :data:`FLOOR_BYTES_PER_TOKEN` (1 MiB with the default 16)."""
    return min_chunk_tokens * FLOOR_BYTES_PER_TOKEN


def _check_dram_floor(values: Mapping[str, Any]) -> None:
    """Refuse an arena too small for one chunk (``--dram-capacity 12`` is 12 bytes, not GiB).
    Checked at start only: dram-capacity cannot change at run time."""
    size, tokens = values["dram-capacity"], values["min-chunk-tokens"]
    floor = dram_floor(tokens)
    if size >= floor:
        return
    hint = ""
    if size and size * 1024**3 >= floor:
        hint = f"; a size without a unit is in bytes: write {size}GiB for {size} GiB"
    raise ConfigError(
        f"invalid value for 'dram-capacity': {size} bytes is below the smallest arena, "
        f"{format_size(floor)} (one chunk of min-chunk-tokens = {tokens} tokens at "
        f"{FLOOR_BYTES_PER_TOKEN // 1024} KiB of KV per token){hint}"
    )


def render_markdown() -> str:
    lines = [
        "# Configuration",
        "",
        "Generated by `python -m kvstrata.config`; `tests/test_docs.py` fails when stale.",
        "",
        "Every key can be given as a flag (`kvstrata serve --dram-capacity 4GiB`), an environment",
        "variable (`KVSTRATA_DRAM_CAPACITY=4GiB`) or a key of the TOML file passed with",
        '`--config` (`dram-capacity = "4GiB"`); flags win over the environment, which wins over',
        "the file. `CONFIG GET *` lists them all; keys marked *runtime* can be changed with",
        "`CONFIG SET`. Sizes take B, KiB, MiB, GiB, TiB (powers of 1024) or KB, MB, GB (powers",
        "of 1000). A size, count or duration is never a boolean: `nvme-capacity = true` (or",
        "`false`) in the TOML file stops start-up with a message naming the key instead of",
        'counting as 1 (or 0); write a number or a quoted size (`nvme-capacity = "16GiB"`,',
        "`nvme-capacity = 0` to disable the tier). A TOML float is no integer (`port = 7379.5`).",
        "",
        "The keys are grouped as in `kvstrata serve --help` (and as redis.conf's sections); the",
        "value column is the metavar `--help` shows: `SIZE` a size, `MS`/`SECONDS`/`MICROS` a",
        "duration in that unit, `N` a count, `RATIO` a number above 0 and at most 1.",
        "`dram-capacity` must hold one chunk of `min-chunk-tokens` tokens at 64 KiB of KV per",
        "token (1MiB with the default 16): `--dram-capacity 12` (12 bytes) stops start-up.",
    ]
    for title, options in grouped_options():
        lines += ["", f"## {title}", "", "| key | value | default | runtime | meaning |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for o in options:
            default = o.fmt(o.default) if o.default != "" else "(empty)"
            value = metavar(o).replace("|", "\\|")
            lines.append(
                f"| `{o.name}` | `{value}` | `{default}` | {'yes' if o.mutable else ''} | "
                f"{o.doc} |"
            )
    return "\n".join(lines) + "\n"


def option_names() -> list[str]:
    return [o.name for o in OPTIONS]


def option(name: str) -> Option | None:
    return _BY_NAME.get(name)


if __name__ == "__main__":  # pragma: no cover
    print(render_markdown(), end="")

__all__ = ["OPTIONS", "Config", "ConfigError", "fields", "load_config", "parse_size"]
