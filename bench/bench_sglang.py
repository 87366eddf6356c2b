"""SGLang 0.5.23 HiCache L3 storage: kvstrata's backend against SGLang's own ``file`` backend.

Run in the SGLang venv (``scripts/engines/sglang.sh --install-only`` makes it)::

    PYTHONPATH=$PWD ~/.cache/kvstrata/venvs/sglang-0.5.23/bin/python bench/bench_sglang.py

Both backends are built by SGLang's ``StorageBackendFactory`` (``file`` with its directory under
``--dir``, default a temporary directory, and ``dynamic`` for kvstrata against a
``kvstrata serve`` started here). For pages of 1, 8 and 32 MiB (bf16, page_first host pool of
``--bytes`` per size), GB/s of ``batch_set``/``batch_get`` (the generic path HiCache uses without
``interface_v1``, flat page tensors) on fresh keys, and for kvstrata also the zero-copy
``batch_set_v1``/``batch_get_v1`` over the host pool. Median of ``--repeat`` rounds. The file
backend writes to the page cache (no fsync), as SGLang's does.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
logging.disable(logging.WARNING)

from _servers import kvstrata_server  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

from tests.engines.sglang.hostpool import PageFirstHostPool  # noqa: E402


def config(extra: dict[str, Any]) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="bench/model", extra_config=extra,
    )  # fmt: skip


def rate(fn: Callable[[], object], nbytes: int) -> float:
    t = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - t) / 1e9


def generic(backend: Any, pool: PageFirstHostPool, pages: int, rnd: int) -> tuple[float, float]:
    keys = [f"{pool.layer_num}r{rnd}p{i}" for i in range(pages)]
    values = [pool.get_data_page(i * pool.page_size) for i in range(pages)]
    targets = [pool.get_dummy_flat_data_page() for _ in range(pages)]
    nbytes = sum(v.numel() * v.element_size() for v in values)
    stored: list[bool] = []
    got: list[Any] = []
    put = rate(lambda: stored.append(backend.batch_set(keys, values)), nbytes)
    get = rate(lambda: got.extend(backend.batch_get(keys, targets)), nbytes)
    if not all(stored) or any(t is None for t in got):
        raise RuntimeError(f"{type(backend).__name__}: stored {stored}, {got.count(None)} misses")
    return put, get


def zero_copy(backend: Any, pool: PageFirstHostPool, pages: int, rnd: int) -> tuple[float, float]:
    keys = [f"v1{pool.layer_num}r{rnd}p{i}" for i in range(pages)]
    nbytes = pool.kv_buffer.numel() * pool.kv_buffer.element_size() // 2
    src, dst = pool.page_indices(0, pages), pool.page_indices(pages, pages)
    put = rate(lambda: backend.batch_set_v1(keys, src), nbytes)
    got: list[bool] = []
    get = rate(lambda: got.extend(backend.batch_get_v1(keys, dst)), nbytes)
    if not all(got):
        raise RuntimeError("page not read back")
    return put, get


def median_pair(fn: Callable[[int], tuple[float, float]], repeat: int) -> tuple[float, float]:
    runs = [fn(r) for r in range(repeat)]
    return statistics.median(p for p, _ in runs), statistics.median(g for _, g in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bytes", type=int, default=64, help="MiB written and read per size")
    ap.add_argument("--dir", default=None, help="directory of the file backend")
    args = ap.parse_args()
    rows = []
    with (
        tempfile.TemporaryDirectory(dir=args.dir) as tmp,
        kvstrata_server("--dram-capacity", "2GiB", "--nvme-capacity", "0") as kv,
    ):
        for mib in (1, 8, 32):
            pages = max(2, args.bytes // mib)
            # a page of 64 tokens × mib layers × 8 heads × 128, K and V, bf16 = mib MiB
            pool = PageFirstHostPool(2 * pages, page_size=64, layer_num=mib, head_num=8,
                                     head_dim=128)  # fmt: skip
            pool.kv_buffer.normal_()
            file_be = StorageBackendFactory.create_backend(
                "file", config({"file_storage_path": f"{tmp}/{mib}"}), pool
            )
            kv_extra = {"backend_name": "kvstrata", "module_path": "kvstrata.clients.sglang",
                        "class_name": "KvstrataHiCacheStorage",
                        "url": f"redis://127.0.0.1:{kv.port}"}  # fmt: skip
            kv_be = StorageBackendFactory.create_backend("dynamic", config(kv_extra), pool)
            for be in (file_be, kv_be):
                be.register_mem_pool_host(pool)
            f = median_pair(lambda r: generic(file_be, pool, pages, r), args.repeat)  # noqa: B023
            k = median_pair(lambda r: generic(kv_be, pool, pages, r), args.repeat)  # noqa: B023
            z = median_pair(lambda r: zero_copy(kv_be, pool, pages, r), args.repeat)  # noqa: B023
            kv_be.close()
            rows.append((mib, f, k, z))
    print("\nGB/s (median): batch_set / batch_get\n")
    print("| page | file backend set | file get | kvstrata set | kvstrata get "
          "| kvstrata set_v1 | kvstrata get_v1 |")  # fmt: skip
    print("|---" * 7 + "|")
    for mib, f, k, z in rows:
        cells = " | ".join(f"{x:.2f}" for x in (*f, *k, *z))
        print(f"| {mib} MiB | {cells} |")


if __name__ == "__main__":
    main()
