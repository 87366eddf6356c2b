"""Models, hardware and the seeds' arithmetic of recompute versus load.

- prefill FLOPs ≈ 2 × parameters × tokens (the weights' matmuls; attention's quadratic term is
  left out, as in the seeds);
- KV bytes = 2 (K and V) × layers × KV heads × head size × tokens × bytes per element;
- load time = latency + bytes / bandwidth of the link from the tier that holds the prefix;
- recompute time = FLOPs / (GPU peak × MFU).

Worked example (checked in tests/test_sim.py): a 32,768-token prompt on Llama-3-70B (80 layers,
8 KV heads of 128) costs 2 × 70e9 × 32768 ≈ 4,590 TFLOPs (4,630 with the exact 70.6e9
parameters) — the seeds' "~4,500". Its 8-bit KV is 2 × 80 × 8 × 128 × 32768 × 1 B = 5.37 GB,
not the seeds' "~1 GB" (1 GB is 6,100 tokens of this model); 1 GB over PCIe Gen5 (64 GB/s) is
15.6 ms as the seeds say, the real 5.37 GB take 84 ms — still 20× less than recomputing at
989 TFLOP/s and 50 % MFU (9.3 s).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Model:
    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int
    kv_bytes: float = 2.0  # bytes per element (bf16: 2, fp8/int8: 1)

    def prefill_flops(self, tokens: int) -> float:
        return 2.0 * self.params * tokens

    def kv_size(self, tokens: int) -> float:
        return 2.0 * self.layers * self.kv_heads * self.head_dim * tokens * self.kv_bytes


MODELS = {
    "llama-3-8b": Model("llama-3-8b", 8.03e9, 32, 8, 128),
    "llama-3-70b": Model("llama-3-70b", 70.6e9, 80, 8, 128),
}


def model_from_config(path: str | Path, kv_bytes: float = 2.0) -> Model:
    """A model from a transformers ``config.json`` (parameters estimated from its shapes)."""
    cfg = json.loads(Path(path).read_text())
    try:
        hidden = int(cfg["hidden_size"])
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads", heads))
        inter = int(cfg.get("intermediate_size", 4 * hidden))
        vocab = int(cfg.get("vocab_size", 32000))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: not a transformers model config ({exc})") from None
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    attn = hidden * head_dim * (heads * 2 + kv_heads * 2)
    mlp = 3 * hidden * inter
    params = layers * (attn + mlp) + 2 * vocab * hidden
    return Model(Path(path).stem, float(params), layers, kv_heads, head_dim, kv_bytes)


@dataclass(frozen=True, slots=True)
class Hardware:
    """GPU peak (dense bf16 FLOP/s) and the links from each tier to the GPU (bytes/s, s)."""

    name: str
    peak_flops: float
    links: dict[str, tuple[float, float]]  # tier → (bandwidth, latency)


GB = 1e9
PCIE5 = (64 * GB, 10e-6)  # x16 Gen5, per direction
NVME_GEN5 = (14 * GB, 80e-6)  # one Gen5 drive, sequential read
NVME_GEN5_X4 = (4 * 14 * GB, 80e-6)
NET = {"100g": (12.5 * GB, 2e-3), "200g": (25 * GB, 2e-3), "400g": (50 * GB, 2e-3)}
GPUS = {"h100": 989e12, "h200": 989e12}
HBM = {"h100": (3.35e12, 1e-6), "h200": (4.8e12, 1e-6)}


def hardware(gpu: str = "h100", nvme: str = "1xgen5", net: str = "100g") -> Hardware:
    """A preset: GPU (h100, h200), NVMe (1xgen5, 4xgen5), network for s3 (100g…400g)."""
    if gpu not in GPUS or nvme not in ("1xgen5", "4xgen5") or net not in NET:
        raise ValueError(
            f"unknown hardware {gpu}/{nvme}/{net} (gpu: h100, h200; nvme: 1xgen5, 4xgen5; "
            "net: 100g, 200g, 400g)"
        )
    links = {
        "gpu": HBM[gpu],
        "dram": PCIE5,
        "nvme": NVME_GEN5 if nvme == "1xgen5" else NVME_GEN5_X4,
        "s3": NET[net],
    }
    return Hardware(f"{gpu}+{nvme}+{net}", GPUS[gpu], links)


def load_seconds(nbytes: float, link: tuple[float, float]) -> float:
    bandwidth, latency = link
    return latency + nbytes / bandwidth


def recompute_seconds(model: Model, tokens: int, hw: Hardware, mfu: float) -> float:
    return model.prefill_flops(tokens) / (hw.peak_flops * mfu)
