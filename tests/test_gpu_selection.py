"""Run-time selection of the GPU tier and the messages a user reads (no CUDA needed).

torch and CuPy are replaced through ``gpu_select._import`` (the one seam the probe imports
through), so every branch runs on any machine: CUDA present, absent, a CPU-only torch, a
missing device, neither library installed.
"""

from __future__ import annotations

import asyncio
import types
from typing import Any

import pytest

from kvstrata.config import load_config
from kvstrata.tiers import gpu_select
from kvstrata.tiers.base import TierUnavailable, build_tier
from kvstrata.tiers.gpu import GpuConfig, GpuTier
from kvstrata.tiers.gpu_select import gpu_available, gpu_status, require_gpu

GiB = 1024**3


def fake_torch(available: bool, count: int = 1, cuda: str | None = "12.4") -> Any:
    cuda_mod = types.SimpleNamespace(
        is_available=lambda: available,
        device_count=lambda: count,
        get_device_name=lambda d: "NVIDIA H200",
    )
    return types.SimpleNamespace(
        __version__="2.13.0", version=types.SimpleNamespace(cuda=cuda), cuda=cuda_mod
    )


def fake_cupy(count: int | Exception) -> Any:
    def get_count() -> int:
        if isinstance(count, Exception):
            raise count
        return count

    runtime = types.SimpleNamespace(getDeviceCount=get_count)
    return types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))


@pytest.fixture
def modules(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Modules the probe sees; a missing name raises ImportError like an absent package."""
    table: dict[str, Any] = {}

    def fake_import(name: str) -> Any:
        if name not in table:
            raise ImportError(f"No module named {name!r}")
        return table[name]

    monkeypatch.setattr(gpu_select, "_import", fake_import)
    return table


def test_torch_sees_no_cuda(modules: dict[str, Any]) -> None:
    modules["torch"] = fake_torch(False)
    ok, why = gpu_available(0)
    assert not ok
    assert why.startswith("torch.cuda.is_available() is False: ")
    assert "finds no usable NVIDIA driver/device" in why


def test_cpu_only_torch_build(modules: dict[str, Any]) -> None:
    modules["torch"] = fake_torch(False, cuda=None)
    assert gpu_available(0) == (
        False,
        "torch.cuda.is_available() is False: torch 2.13.0 is a CPU-only build",
    )


def test_real_torch_is_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the installed torch and is_available patched to False, its answer is reported."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ok, why = gpu_available(0)
    assert not ok and "torch.cuda.is_available() is False" in why


def test_cuda_present(modules: dict[str, Any]) -> None:
    modules["torch"] = fake_torch(True, count=2)
    assert gpu_available(1) == (True, "cuda:1 (NVIDIA H200) via torch")


def test_device_out_of_range(modules: dict[str, Any]) -> None:
    modules["torch"] = fake_torch(True, count=1)
    ok, why = gpu_available(3)
    assert not ok and why == "CUDA device 3 does not exist (torch sees 1 device(s))"


def test_neither_torch_nor_cupy(modules: dict[str, Any]) -> None:
    ok, why = gpu_available(0)
    assert not ok and why.startswith("neither torch nor CuPy is installed")


def test_cupy_without_torch(modules: dict[str, Any]) -> None:
    modules["cupy"] = fake_cupy(1)
    assert gpu_available(0) == (True, "cuda:0 via CuPy")
    modules["cupy"] = fake_cupy(RuntimeError("cudaErrorNoDevice: no CUDA-capable device"))
    ok, why = gpu_available(0)
    assert not ok and "getDeviceCount() failed: cudaErrorNoDevice" in why


def test_both_libraries_explain(modules: dict[str, Any]) -> None:
    modules["torch"] = fake_torch(False, cuda=None)
    modules["cupy"] = fake_cupy(0)
    ok, why = gpu_available(0)
    assert not ok
    assert "CPU-only build" in why and "CuPy sees 0 device(s)" in why


def test_cupy_answers_when_torch_cannot(modules: dict[str, Any]) -> None:
    modules["torch"] = fake_torch(False, cuda=None)
    modules["cupy"] = fake_cupy(1)
    assert gpu_available(0) == (True, "cuda:0 via CuPy")


def test_require_gpu_message(modules: dict[str, Any]) -> None:
    modules["torch"] = fake_torch(False, cuda=None)
    with pytest.raises(TierUnavailable) as err:
        require_gpu(8 * GiB, 0)
    assert str(err.value) == (
        "gpu-capacity is 8GiB but CUDA is not available (torch.cuda.is_available() is False: "
        "torch 2.13.0 is a CPU-only build); set --gpu-capacity 0"
    )
    modules["torch"] = fake_torch(True)
    assert require_gpu(8 * GiB, 0) == "cuda:0 (NVIDIA H200) via torch"


def test_building_the_tier_without_cuda_stops(modules: dict[str, Any]) -> None:
    """build_tier (what the store's from_config calls) raises before allocating anything."""
    modules["torch"] = fake_torch(False)
    with pytest.raises(TierUnavailable, match=r"gpu-capacity is 1GiB but CUDA is not available"):
        build_tier("gpu", GpuConfig(capacity=GiB))


def test_capacity_zero_is_no_tier() -> None:
    with pytest.raises(TierUnavailable, match="gpu-capacity is 0"):
        GpuTier(GpuConfig(capacity=0))


def test_status_lines(modules: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_select, "driver_nodes_present", lambda: True)
    assert gpu_status(0, 0) == "disabled: gpu-capacity is 0"
    monkeypatch.setattr(gpu_select, "driver_nodes_present", lambda: False)
    assert gpu_status(0, 0).startswith("absent: no CUDA (no NVIDIA device nodes)")
    modules["torch"] = fake_torch(False, cuda=None)
    assert gpu_status(GiB, 0) == (
        "absent: no CUDA (torch.cuda.is_available() is False: torch 2.13.0 is a CPU-only build)"
    )
    modules["torch"] = fake_torch(True)
    assert gpu_status(GiB, 0) == "enabled: cuda:0 (NVIDIA H200) via torch"


def test_status_with_capacity_zero_imports_nothing(modules: dict[str, Any]) -> None:
    modules["torch"] = object()  # any attribute access would fail
    assert gpu_status(0, 0).split(":")[0] in ("disabled", "absent")


def test_config_keys() -> None:
    cfg = load_config(flags={"gpu-capacity": "2GiB", "gpu-device": "1"}, env={})
    gc = GpuConfig.from_config(cfg)
    assert (gc.device, gc.capacity, gc.region_name) == (1, 2 * GiB, "gpu1")
    default = GpuConfig.from_config(load_config(flags={}, env={}))
    assert default.capacity == 0


def test_store_refuses_to_start_without_cuda(modules: dict[str, Any], tmp_path: Any) -> None:
    """A configuration asking for a GPU tier on a machine without CUDA stops start-up."""
    from kvstrata.store.keyspace import Keyspace
    from kvstrata.store.kvstore import KVStore

    modules["torch"] = fake_torch(False, cuda=None)
    cfg = load_config(
        flags={"gpu-capacity": "8GiB", "dram-capacity": "4MiB", "nvme-capacity": "0",
               "data-dir": str(tmp_path)},
        env={},
    )  # fmt: skip

    async def body() -> None:
        with pytest.raises(TierUnavailable) as info:
            await KVStore.from_config(cfg, Keyspace())
        assert "gpu-capacity is 8GiB but CUDA is not available" in str(info.value)
        assert str(info.value).endswith("set --gpu-capacity 0")

    asyncio.run(body())


def test_cli_prints_tier_errors_as_cannot_start() -> None:
    from kvstrata import cli

    assert issubclass(TierUnavailable, cli._startup_errors())
