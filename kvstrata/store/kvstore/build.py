"""Which tiers a configuration builds, in which order, and what INFO says about the GPU tier.

``gpu`` (when ``gpu-capacity`` > 0) is built first, then ``dram`` (always), ``nvme`` (when
``nvme-capacity`` > 0) and ``s3`` (when ``s3-bucket`` is set). A GPU tier asked for on a
machine without CUDA stops start-up with :class:`~kvstrata.tiers.base.TierUnavailable` and the
reason from :func:`~kvstrata.tiers.gpu_select.require_gpu` (the CLI prints it as
``kvstrata: cannot start: …``); tiers built before a failure are closed again.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvstrata.config import Config
from kvstrata.tiers.base import Tier, build_tier
from kvstrata.tiers.gpu_select import gpu_status

_CONFIG_CLASSES = {
    "gpu": ("kvstrata.tiers.gpu", "GpuConfig"),
    "dram": ("kvstrata.tiers.dram", "DramConfig"),
    "nvme": ("kvstrata.tiers.nvme", "NvmeConfig"),
    "s3": ("kvstrata.tiers.s3", "S3Config"),
}


def tier_config(name: str, config: Config) -> Any:
    """The typed config of tier ``name`` (importing its module registers the tier)."""
    module, cls_name = _CONFIG_CLASSES[name]
    return getattr(importlib.import_module(module), cls_name).from_config(config)


def wanted_tiers(config: Config) -> list[str]:
    names = ["gpu"] if config.gpu_capacity > 0 else []
    names.append("dram")
    if config.nvme_capacity > 0:
        names.append("nvme")
    if config.s3_bucket:
        names.append("s3")
    return names


def tier_modules(config: Config) -> list[str]:
    """The modules of the tiers ``config`` asks for (the server imports them off the loop)."""
    return [_CONFIG_CLASSES[name][0] for name in wanted_tiers(config)]


async def build_tiers(config: Config) -> tuple[list[Tier], str]:
    """The configured tiers, fast → slow, and the ``gpu_status`` line (computed once here:
    with ``gpu-capacity 0`` it only looks for NVIDIA device nodes, importing nothing)."""
    status = gpu_status(config.gpu_capacity, config.gpu_device)
    tiers: list[Tier] = []
    try:
        for name in wanted_tiers(config):
            tiers.append(build_tier(name, tier_config(name, config)))
    except BaseException:
        for tier in tiers:
            await tier.close()
        raise
    return tiers, status


def status_of(tiers: list[Tier], device: int) -> str:
    """``gpu_status`` for a store built from explicit tiers (tests, embedding)."""
    gpu = next((t for t in tiers if t.name == "gpu"), None)
    if gpu is None:
        return gpu_status(0, device)
    memory = getattr(gpu, "memory", None)
    backend = getattr(memory, "backend", "?")
    return f"enabled: cuda:{getattr(memory, 'device', device)} via {backend}"
