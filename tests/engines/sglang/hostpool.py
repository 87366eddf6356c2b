"""A CPU stand-in for SGLang 0.5.23's ``MHATokenToKVPoolHost`` with the ``page_first`` layout.

The real pool cannot be built without CUDA (it allocates pinned memory and imports SGLang's GPU
kernels), so the tests use this object with the same buffer shape and the same methods storage
backends call: ``get_page_buffer_meta`` (copied from SGLang's ``page_first`` branch: one K and
one V pointer per page), ``get_data_page``, ``get_dummy_flat_data_page``,
``set_from_flat_data_page``.
"""

from __future__ import annotations

import torch


class PageFirstHostPool:
    layout = "page_first"

    def __init__(
        self,
        pages: int,
        page_size: int = 4,
        layer_num: int = 3,
        head_num: int = 2,
        head_dim: int = 8,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.size = pages * page_size
        self.page_size = page_size
        self.layer_num = layer_num
        self.head_num = head_num
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = "cpu"
        self.kv_buffer = torch.zeros(2, self.size, layer_num, head_num, head_dim, dtype=dtype)

    def page_indices(self, first_page: int, n: int) -> torch.Tensor:
        """Token indices of ``n`` pages from ``first_page`` (what HiCache passes)."""
        start = first_page * self.page_size
        return torch.arange(start, start + n * self.page_size, dtype=torch.int64)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        itemsize = self.dtype.itemsize
        base = self.kv_buffer.data_ptr()
        v_offset = self.layer_num * self.size * self.head_num * self.head_dim * itemsize
        idx = indices.tolist()
        ptrs: list[int] = []
        for i in range(0, len(idx), self.page_size):
            k_ptr = base + idx[i] * self.layer_num * self.head_num * self.head_dim * itemsize
            ptrs += [k_ptr, k_ptr + v_offset]
        size = self.layer_num * itemsize * self.page_size * self.head_num * self.head_dim
        return ptrs, [size] * len(ptrs)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, index : index + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        shape = (2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        shape = (2, self.page_size, self.layer_num, self.head_num, self.head_dim)
        self.kv_buffer[:, index : index + self.page_size] = data_page.reshape(shape)


class LayerFirstHostPool(PageFirstHostPool):
    """The ``layer_first`` layout (``kv_buffer`` is ``[2, layers, tokens, heads, dim]``), with
    SGLang 0.5.23's arithmetic of that branch: ``get_page_buffer_meta`` gives a K and a V
    pointer per layer of each page (K0 V0 K1 V1 …), while ``get_data_page`` (the generic path's
    page) is all K layers, then all V layers."""

    layout = "layer_first"

    def __init__(self, pages: int, **kwargs: object) -> None:
        super().__init__(pages, **kwargs)  # type: ignore[arg-type]
        shape = (2, self.layer_num, self.size, self.head_num, self.head_dim)
        self.kv_buffer = torch.zeros(shape, dtype=self.dtype)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        itemsize = self.dtype.itemsize
        row = self.head_num * self.head_dim * itemsize
        base = self.kv_buffer.data_ptr()
        v_offset = self.layer_num * self.size * row
        idx = indices.tolist()
        ptrs: list[int] = []
        for i in range(0, len(idx), self.page_size):
            for layer in range(self.layer_num):
                k_ptr = base + idx[i] * row + layer * self.size * row
                ptrs += [k_ptr, k_ptr + v_offset]
        return ptrs, [self.page_size * row] * len(ptrs)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, :, index : index + self.page_size]
        return page.flatten() if flat else page

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        shape = (2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        self.kv_buffer[:, :, index : index + self.page_size] = data_page.reshape(shape)
