"""TEST SCAFFOLDING, never installed: a stand-in for the ``sgl_kernel`` package (``sgl-kernel`` /
``sglang-kernel`` on PyPI, whose wheels hold only CUDA objects) so that SGLang 0.5.23 runs on a
CPU without AMX, where it uses ``torch_native`` attention. Only the two ops SGLang 0.5.23 imports
unconditionally on CPU are here, in plain torch:

- ``copy_all_layer_kv_cache_cpu`` (imported by ``sglang/kernels/ops/kvcache/cache_move.py``)
- ``assign_req_to_token_pool_cpu`` (imported by ``sglang/srt/mem_cache/allocation.py``)

Every other name (SGLang imports more CPU ops at module level that a plain Llama with HiCache
never calls: ``build_tree_kernel_efficient_cpu`` / ``verify_tree_greedy_cpu`` for speculative
decoding in ``sglang/kernels/ops/speculative/spec_tree.py``, and so on) is a function that raises
NotImplementedError when called, so an unexpected use fails loudly instead of computing garbage.

On a GPU server the real sgl-kernel is installed and this folder is not on the path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch

__version__ = "0.0.0+kvstrata-test-shim"


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For each buffer (base pointer, row stride in bytes), copy row ``src_loc[i]`` to row
    ``tgt_loc[i]``; reads every source row before writing (safe in place), as the Triton
    kernel ``copy_all_layer_kv_cache_tiled`` it stands in for is."""
    src, tgt = src_loc.tolist(), tgt_loc.tolist()
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = [ctypes.string_at(base + s * stride, stride) for s in src]
        for t, row in zip(tgt, rows, strict=True):
            ctypes.memmove(base + t * stride, row, stride)


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``req_to_token[req, start:end] = out_cache_loc[next end-start slots]`` per request, the
    slots taken in request order (the Triton kernel ``assign_req_to_token_pool``)."""
    del pool_len  # the row length; req_to_token's own shape says it
    offset = 0
    for req, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        n = end - start
        req_to_token[req, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def __getattr__(name: str) -> Callable[..., Any]:
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"sgl_kernel.{name}: not in the kvstrata CPU test stand-in")

    missing.__name__ = name
    return missing
