"""The tier contract suite (tests/test_tier_contract.py) run against the S3 tier on moto.

Every ``test_*`` of the contract module is re-collected here with this module's ``case``
fixture, so new contract tests apply to S3 without editing the shared file. The S3 case lowers
the multipart threshold to 1 MiB so the suite's larger sizes go through multipart uploads.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kvstrata.tiers.base import Tier
from kvstrata.tiers.s3 import S3Config, S3Tier
from tests import test_tier_contract as contract

if TYPE_CHECKING:
    from tests.s3fixture import MotoServer

pytest_plugins = ["tests.s3fixture"]

MiB = 1024 * 1024

globals().update({n: getattr(contract, n) for n in dir(contract) if n.startswith("test_")})


@pytest.fixture
def case(moto_server: MotoServer) -> contract.TierCase:
    bucket = moto_server.make_bucket()

    async def make(tmp_path: Path) -> Tier:
        config = S3Config(
            bucket=bucket,
            endpoint=moto_server.endpoint,
            max_connections=4,
            timeout=5.0,
            retries=1,
            multipart_threshold=MiB,
            multipart_chunksize=5 * MiB,
        )
        return S3Tier(config)

    return contract.TierCase("s3", make, bounded=False)
