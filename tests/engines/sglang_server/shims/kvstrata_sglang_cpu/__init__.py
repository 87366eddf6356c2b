"""TEST SCAFFOLDING, never installed: a general SGLang plugin (entry point group
``sglang.srt.plugins``, found through the ``kvstrata_sglang_cpu-0.0.dist-info`` folder beside it on
PYTHONPATH) that lets SGLang 0.5.23's HiCache host pool run when the "device" is the CPU.

What it stands in for, in SGLang 0.5.23:

- ``sglang/srt/mem_cache/pool_host/common.py``: ``ALLOC_MEMORY_FUNCS`` has no ``cpu`` entry, so
  the host pool is allocated by ``alloc_with_host_register``, which registers it with
  ``torch.cuda.cudart()`` (absent from CPU torch). Here ``cpu`` allocates without registering.
- ``sglang/srt/mem_cache/pool_host/mha.py``: ``MHATokenToKVPoolHost.load_to_device_per_layer``
  and ``backup_from_device_all_layer`` copy only through CUDA/HIP kernels (``transfer_kv_*``
  from sgl_kernel). Here, when the pool's device is the CPU, they copy by torch indexing for the
  ``page_first`` and ``layer_first`` layouts (both keep a per-layer view of the host pool in
  ``k_data_refs`` / ``v_data_refs``). Its ``get_dummy_flat_data_page`` (the generic, non-v1
  storage path's read buffer) asks torch for pinned memory, which CPU torch refuses: here, on
  the CPU, the same zeros unpinned.

Nothing here touches the L3 path (``kvstrata.clients.sglang``): pages reach kvstrata from the
host pool exactly as on a GPU server.
"""

from __future__ import annotations

from typing import Any

import torch

_LAYOUTS = ("page_first", "layer_first")


def _alloc_cpu(
    dims: tuple[int, ...],
    dtype: torch.dtype,
    device: str,
    pin_memory: bool,
    allocator: Any,
    registration_granularity_bytes: int | None = None,
) -> torch.Tensor:
    del pin_memory, registration_granularity_bytes  # nothing to pin for a CPU "device"
    return allocator.allocate(dims, dtype=dtype, device=device)


def _copy(
    dst: torch.Tensor, dst_idx: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor
) -> None:
    rows = src[src_idx.to(torch.long)]
    dst[dst_idx.to(torch.long)] = rows.reshape((rows.shape[0], *dst.shape[1:])).to(dst.dtype)


def _on_cpu(pool: Any) -> bool:
    return getattr(pool, "_transfer_device", None) is not None and (
        pool._transfer_device.type == "cpu" and pool.layout in _LAYOUTS
    )


def _load_to_device_per_layer(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    if not _on_cpu(self):
        return original(self, *args, **kwargs)
    names = ("device_pool", "host_indices", "device_indices", "layer_id", "io_backend")
    bound = dict(zip(names, args, strict=False)) | kwargs
    layer = bound["layer_id"]
    if not kwargs.get("is_draft", False) and not 0 <= layer < self.target_layer_num:
        return None
    host, dev = bound["host_indices"], bound["device_indices"]
    _copy(self.device_k_buffers[layer], dev, self.k_data_refs[layer], host)
    _copy(self.device_v_buffers[layer], dev, self.v_data_refs[layer], host)
    return None


def _backup_from_device_all_layer(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    if not _on_cpu(self):
        return original(self, *args, **kwargs)
    names = ("device_pool", "host_indices", "device_indices", "io_backend")
    bound = dict(zip(names, args, strict=False)) | kwargs
    host, dev = bound["host_indices"], bound["device_indices"]
    for layer in range(len(self.device_k_buffers)):
        _copy(self.k_data_refs[layer], host, self.device_k_buffers[layer], dev)
        _copy(self.v_data_refs[layer], host, self.device_v_buffers[layer], dev)
    return None


def _get_dummy_flat_data_page(original: Any, self: Any) -> Any:
    if not _on_cpu(self):
        return original(self)
    shape = (2, self.layer_num, self.page_size, self.head_num, self.head_dim)
    return torch.zeros(shape, dtype=self.dtype, device=self.device).flatten()


def register() -> None:
    """The plugin's entry point, called by ``sglang.srt.plugins.load_plugins`` in each process."""
    from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    ALLOC_MEMORY_FUNCS["cpu"] = _alloc_cpu
    target = "sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost"
    HookRegistry.register(f"{target}.load_to_device_per_layer", _load_to_device_per_layer,
                          HookType.AROUND)  # fmt: skip
    HookRegistry.register(f"{target}.get_dummy_flat_data_page", _get_dummy_flat_data_page,
                          HookType.AROUND)  # fmt: skip
    HookRegistry.register(f"{target}.backup_from_device_all_layer", _backup_from_device_all_layer,
                          HookType.AROUND)  # fmt: skip
