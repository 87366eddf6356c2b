"""Settings of the S3 tier (:class:`S3Config`) and the boto3 client they describe.

Kept apart from :mod:`kvstrata.tiers.s3` so that the tier module holds the async contract
only. ``auth_key`` (``s3-auth-key``) is a secret: it is left out of the dataclass's repr.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvstrata.codecs.tier import TIER_CODECS
from kvstrata.tiers.base import TierUnavailable

MiB = 1024 * 1024
_MIN_PART = 5 * MiB  # S3's smallest multipart part (except the last)


@dataclass(frozen=True, slots=True)
class S3Config:
    """Settings of the S3 tier (``s3-*`` options plus tuning knobs with defaults)."""

    bucket: str
    endpoint: str = ""  # empty: AWS, resolved by boto3 from the region
    region: str = "us-east-1"
    prefix: str = "kvstrata"
    max_connections: int = 16
    timeout: float = 10.0  # connect and read timeout of one attempt, seconds
    retries: int = 2  # attempts after the first (botocore standard retry mode)
    multipart_threshold: int = 64 * MiB
    multipart_chunksize: int = 16 * MiB
    write_policy: str = "write-back"  # kept for INFO; the store applies it
    negative_ttl: float = 1.5  # seconds a miss is remembered (0 disables)
    retry_after: float = 1.0  # seconds the breaker fails fast after an endpoint failure
    #: s3-codec: lossless codec applied to chunks as they are uploaded (kvstrata.codecs.tier)
    codec: str = "none"
    #: s3-auth-key: objects are tagged and checked with it (empty: no tags); never shown
    auth_key: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        if not self.bucket:
            raise TierUnavailable("s3 tier needs a bucket (s3-bucket)")
        if self.max_connections < 1 or self.timeout <= 0 or self.retries < 0:
            raise TierUnavailable("s3: max_connections ≥ 1, timeout > 0, retries ≥ 0")
        if self.multipart_chunksize < _MIN_PART:
            raise TierUnavailable(f"s3: multipart_chunksize must be ≥ {_MIN_PART} bytes")
        if self.codec not in TIER_CODECS:
            raise TierUnavailable(f"s3-codec must be one of {', '.join(TIER_CODECS)}")

    @classmethod
    def from_config(cls, cfg: Any, **overrides: Any) -> S3Config:
        """Build from a :class:`kvstrata.config.Config` (keys ``s3-*``)."""
        values: dict[str, Any] = {
            "bucket": cfg.get("s3-bucket"),
            "endpoint": cfg.get("s3-endpoint"),
            "region": cfg.get("s3-region"),
            "prefix": cfg.get("s3-prefix"),
            "write_policy": cfg.get("s3-write-policy"),
            "max_connections": cfg.get("s3-max-connections"),
            "timeout": float(cfg.get("s3-timeout")),
            "codec": cfg.get("s3-codec"),
            "auth_key": str(cfg.get("s3-auth-key")).encode(),
        }
        values.update(overrides)
        return cls(**values)


def connect(config: S3Config, concurrency: int) -> tuple[Any, Any]:
    """A boto3 S3 client and a TransferConfig for ``config`` (``concurrency``: parts of one
    multipart upload in flight)."""
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config as BotoConfig

    boto_config = BotoConfig(
        region_name=config.region,
        max_pool_connections=config.max_connections + concurrency,
        connect_timeout=config.timeout,
        read_timeout=config.timeout,
        retries={"mode": "standard", "total_max_attempts": config.retries + 1},
        # Our own xxh3 checksum covers the bytes; CRC trailers break older S3 clones.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3={"addressing_style": "path"} if config.endpoint else None,
    )
    # Credentials come from boto3's standard chain (env, files, IMDS); never logged.
    client = boto3.session.Session().client(
        "s3", endpoint_url=config.endpoint or None, config=boto_config
    )
    transfer = TransferConfig(
        multipart_threshold=config.multipart_threshold,
        multipart_chunksize=config.multipart_chunksize,
        max_concurrency=concurrency,
    )
    return client, transfer
