"""The compiled small-command path: scan, dispatch and reply in C for the hottest commands.

``kvstrata.server._fastpath`` (built by ``setup.py`` when a compiler is present, like the
request scanner) runs the leading commands of a connection's buffer straight against the
string store — ``PING``, ``ECHO``, ``GET``, ``SET key value`` (no option) and ``EXISTS`` — and
the KV store — ``KV.MATCH`` and ``KV.MGET`` of a chain the index holds (``_fastpath_kv.h``,
bound by :func:`bind_store` once the store is built) — and appends their replies. It stops
at the first command it does not handle and the connection's Python path (decoder,
``Connection._execute``, the handlers) takes over from that command; the Python path is the
reference and the only path without the extension.

What it honours, with the same side effects as the Python path (tests/test_fastpath.py runs one
suite through both and compares): replies for RESP2 and RESP3; keyspace hits and misses; the
string store's LRU order and ``used`` bytes; ``INFO commandstats`` calls and time; the slow log
(a command slower than the threshold is handed back with its arguments); commands processed
and the client's last command. What it leaves to Python, command by command: keys with a TTL
(expiry), keys of another type (``WRONGTYPE``, large values in the tiers), a write that would go
over ``maxmemory`` (eviction, ``-OOM``), wrong arity, options, malformed or incomplete input,
quoted inline commands; a command that raises in C (reported through ``sys.unraisablehook``).
For the KV commands, with the side effects of ``commands/kv.py`` (KV.MATCH: ``last_access``
of the matched records; KV.MGET: each chunk read through ``KVStore.get_now``, the reference
read — LRU touch, hits, tier counters, a pin — copied into the reply and its pin released at
once; keyspace hits and misses), it leaves to Python: option words (``WITHTIERS``,
``PREFETCH``) and a last hash one edit from one (the handler warns about it), an invalid
namespace or hash, more hashes than ``max-chain-chunks`` (or than
1,024), a chunk with a TTL, a short match that a shared tier (s3) could extend, and for
KV.MGET a shared tier, a GPU tier above DRAM, a chunk moving or not in DRAM, and 64 KiB or
more of payload (zero-copy from the arena instead). Nothing is bound while ``trace-file`` is
set: the recorder sees every KV command through the Python handlers.
Whole batches go the Python way (:func:`usable`, asked again after every command the Python
path runs) while a client is not authenticated, the server is loading, a ``MONITOR`` is
attached, or the latency histograms of the metrics endpoint are on.

``fast-path no`` (``CONFIG SET fast-path no``, ``--fast-path no``, ``KVSTRATA_FAST_PATH=no``)
sends every command the Python way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from kvstrata.chunks import ChunkKey
from kvstrata.server.cmdstats import CommandStat
from kvstrata.store.index import ChunkRecord
from kvstrata.store.keyspace import StringEntry
from kvstrata.store.kvstore.state import NOT_NOW
from kvstrata.store.strings import ENTRY_OVERHEAD, LARGE_VALUE

if TYPE_CHECKING:
    from kvstrata.server.app import Server
    from kvstrata.tiers.arena import ArenaTier

#: the registry names of the commands the C path runs, in its index order (``last`` of a run)
NAMES = ("PING", "ECHO", "GET", "SET", "EXISTS", "KV.MATCH", "KV.MGET")
#: reply bytes one run produces at most before the connection flushes (a GET of a 60 KiB value
#: costs 20 bytes of input: the output of a buffered batch is bounded here, not by the input)
MAX_OUT = 256 * 1024


def _load() -> Any:
    try:
        from kvstrata.server import _fastpath  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _fastpath


_ext = _load()
#: the extension is built (python3 setup.py build_ext, or any pip install with a compiler)
AVAILABLE = _ext is not None
#: the base type of server.connection.Connection: ``_fastpath.ConnBase`` (its read callbacks
#: in C, over the state they test kept as C fields), or ``object`` without the extension
CONN_BASE: Any = object if _ext is None else _ext.ConnBase


def bind(server: Server) -> Any:
    """The compiled path bound to ``server``'s stores, or None when it is not built. It keeps
    their containers (``keyspace._data``, ``strings._lru``, ``cmdstats.commands``,
    ``strings.config.values``): those are changed in place, never rebound."""
    if _ext is None:
        return None
    return _ext.FastPath(
        server.keyspace, server.strings, server.cmdstats, StringEntry, CommandStat, LARGE_VALUE,
        ENTRY_OVERHEAD,
    )  # fmt: skip


def bind_store(server: Server) -> None:
    """Give the compiled path the KV store's structures once it is built (``Server.load``), so
    that it runs ``KV.MATCH`` and ``KV.MGET`` too; not while commands are traced
    (``trace-file``: the recorder sees every KV command through the Python handlers)."""
    fast = server.fastpath
    store = server.store
    tracing = server.tracer is not None or server.config.values.get("trace-file")
    if fast is None or store is None or tracing:
        return
    state = store.state
    dram = state.dram
    fast.bind_kv(
        state.index._records, ChunkKey, ChunkRecord, store, NOT_NOW, dram,
        None if dram is None else cast("ArenaTier", dram)._chunks, state.tiers,
        state.remote is not None,
        server.config.values,
    )  # fmt: skip


def usable(server: Server, authenticated: bool) -> bool:
    """Whether a batch may start on the compiled path (see the module docstring)."""
    return (
        authenticated
        and server.config.values["fast-path"]
        and not server.loading
        and not server.monitors
        and not server.cmdstats.histograms
    )
