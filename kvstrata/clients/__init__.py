"""Python clients for kvstrata: sync and async ``KV.*`` clients, zero-copy handle mapping, and
the chunk hashing the server uses (so an engine's hashes always match the server's).

Heavy optional parts (torch, transformers integration, codecs) are imported from their own
modules (``kvstrata.clients.hf``, ``.layout``, ``.codecs``), not here.
"""

from kvstrata.clients.aio import (
    AsyncClient,
    AsyncLease,
    AsyncPipeline,
    AsyncWriteBatch,
    AsyncWriteLease,
)
from kvstrata.clients.connection import ConnectionClosedError, ConnectionSettings
from kvstrata.clients.handles import CudaUnavailable, RegionMapError
from kvstrata.clients.resp import BufferTooSmall
from kvstrata.clients.results import (
    BatchGrant,
    Handle,
    LeaseGrant,
    MatchResult,
    RegionInfo,
    ReserveGrant,
    TokenMatch,
)
from kvstrata.clients.sync import Client, Lease, Pipeline, WriteBatch, WriteLease
from kvstrata.protocol.errors import (
    CommandError,
    LeaseError,
    LeaseLimitError,
    NoAuthError,
    OutOfMemoryError,
    RespError,
    WrongPassError,
)
from kvstrata.store.hashing import chunk_hashes, pack_tokens, seed

__all__ = [
    "AsyncClient",
    "AsyncLease",
    "AsyncPipeline",
    "AsyncWriteBatch",
    "AsyncWriteLease",
    "BatchGrant",
    "BufferTooSmall",
    "Client",
    "CommandError",
    "ConnectionClosedError",
    "ConnectionSettings",
    "CudaUnavailable",
    "Handle",
    "Lease",
    "LeaseError",
    "LeaseGrant",
    "LeaseLimitError",
    "MatchResult",
    "NoAuthError",
    "OutOfMemoryError",
    "Pipeline",
    "RegionInfo",
    "RegionMapError",
    "ReserveGrant",
    "RespError",
    "TokenMatch",
    "WriteBatch",
    "WriteLease",
    "WrongPassError",
    "chunk_hashes",
    "pack_tokens",
    "seed",
]
