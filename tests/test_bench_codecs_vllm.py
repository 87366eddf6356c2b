"""``bench/bench_codecs.py --vllm-dump``: a dumped vLLM CPU row is read back as the K and V it
holds (per layer and KV head: K transposed ``[head, block]``, then V ``[block, head]``), and
bad dumps get a clear message."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

torch = pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_codecs.py"
LAYERS, HEADS, BLOCK, HEAD = 2, 2, 32, 64


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_codecs", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(k: torch.Tensor, v: torch.Tensor) -> bytes:
    """vLLM's CPU layout of one block: [layers, heads, (K^T | V)]."""
    parts = torch.stack([k.transpose(2, 3).reshape(LAYERS, HEADS, -1),
                         v.reshape(LAYERS, HEADS, -1)], dim=2)  # fmt: skip
    return parts.contiguous().view(torch.uint8).numpy().tobytes()


def _dump(folder: Path, rows: int) -> tuple[list[bytes], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ks = [
        torch.randn(LAYERS, HEADS, BLOCK, HEAD, generator=g).to(torch.bfloat16) for _ in range(rows)
    ]
    vs = [
        torch.randn(LAYERS, HEADS, BLOCK, HEAD, generator=g).to(torch.bfloat16) for _ in range(rows)
    ]
    blobs = [_row(k, v) for k, v in zip(ks, vs, strict=True)]
    for i, blob in enumerate(blobs):
        (folder / f"{i:04x}.bin").write_bytes(blob)
    meta = {
        "model": "test", "dtype": "bfloat16", "block": BLOCK, "layers": LAYERS, "kv_heads": HEADS,
        "head_size": HEAD, "row_bytes": len(blobs[0]), "chunks": rows,
    }  # fmt: skip
    (folder / "meta.json").write_text(json.dumps(meta))
    return blobs, torch.cat(ks, dim=2), torch.cat(vs, dim=2)


def test_rows_give_back_keys_and_values(tmp_path: Path) -> None:
    blobs, k, v = _dump(tmp_path, 3)
    raw, (k2, v2), meta = _bench().vllm_rows(tmp_path, 3)
    assert raw == b"".join(blobs)
    assert meta["row_bytes"] == LAYERS * HEADS * 2 * BLOCK * HEAD * 2
    assert torch.equal(k2, k) and torch.equal(v2, v)
    assert k2.shape == (LAYERS, HEADS, 3 * BLOCK, HEAD)


def test_too_few_or_wrong_rows_are_refused(tmp_path: Path) -> None:
    _dump(tmp_path, 2)
    bench = _bench()
    with pytest.raises(SystemExit, match="holds 2 chunks"):
        bench.vllm_rows(tmp_path, 3)
    (tmp_path / "0000.bin").write_bytes(b"\0" * 10)
    with pytest.raises(SystemExit, match="is not"):
        bench.vllm_rows(tmp_path, 2)
