"""What kvstrata needs to know about a ``transformers`` model: KV geometry and namespace.

:func:`model_namespace` derives the namespace from everything that changes the meaning of the
cached bytes: architecture, sizes, dtype, chunk size, codec, a digest of the full config and a
fingerprint of the weights. A different model (or the same model in another dtype, or with other
weights) therefore never matches another's chunks.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata.chunks import validate_namespace
from kvstrata.clients.codecs import get_codec

__all__ = ["KVGeometry", "kv_geometry", "model_namespace", "weights_fingerprint"]

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
_SAMPLES_PER_TENSOR = 64


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """Shape of one token's KV: per layer, ``kv_heads * head_dim`` keys and as many values."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def raw_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype.itemsize


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def _model_dtype(model: Any) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def kv_geometry(model: Any) -> KVGeometry:
    """Layers, KV heads, head size and dtype of a decoder-only ``transformers`` model."""
    cfg = _text_config(model.config)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return KVGeometry(cfg.num_hidden_layers, kv_heads, head_dim, _model_dtype(model))


def weights_fingerprint(model: Any) -> str:
    """A cheap digest of the weights: every parameter's name, shape, dtype and 64 evenly spaced
    values. Different checkpoints of one architecture differ in it; hashing every byte of a
    large model would cost seconds."""
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            step = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
            sample = flat[::step][:_SAMPLES_PER_TENSOR].to("cpu", torch.float32)
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
            h.update(sample.numpy().tobytes())
    return h.hexdigest()


def _config_digest(config: Any) -> str:
    data = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    # private keys (paths, commit hashes) and the library version do not change the KV
    keep = {k: v for k, v in data.items() if not k.startswith("_") and k != "transformers_version"}
    text = json.dumps(keep, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def model_namespace(
    model: Any,
    *,
    chunk_tokens: int,
    codec: str = "raw",
    weights: str | bool = True,
    tp: str = "tp1r0",
) -> str:
    """The namespace of ``model``'s KV, e.g.
    ``hf:LlamaForCausalLM@L2.kv2.d16.h64@float32@tp1r0@c16@raw#9f3c…``.

    ``weights``: True fingerprints the parameters (:func:`weights_fingerprint`), a string is
    used as the weights' revision as given, False leaves weights out (only when the caller
    guarantees one checkpoint per config). ``tp`` names the tensor-parallel rank.
    """
    geo = kv_geometry(model)
    cfg = _text_config(model.config)
    archs = getattr(model.config, "architectures", None) or [type(model).__name__]
    arch = _UNSAFE.sub("_", str(archs[0]))[:64]
    dtype = str(geo.dtype).removeprefix("torch.")
    digest = hashlib.sha256(_config_digest(model.config).encode())
    if weights is True:
        digest.update(weights_fingerprint(model).encode())
    elif isinstance(weights, str):
        digest.update(weights.encode())
    sizes = f"L{geo.layers}.kv{geo.kv_heads}.d{geo.head_dim}.h{cfg.hidden_size}"
    name = get_codec(codec).name
    ns = f"hf:{arch}@{sizes}@{dtype}@{_UNSAFE.sub('_', tp)}@c{chunk_tokens}@{name}"
    return validate_namespace(f"{ns}#{digest.hexdigest()[:16]}")
