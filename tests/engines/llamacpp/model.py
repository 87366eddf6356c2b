"""A tiny random Llama for llama.cpp, made here with no download: a SentencePiece tokenizer
trained on generated text (the ``llama`` tokenizer type, which llama.cpp's converter accepts
without its pre-tokenizer hash table), random weights from ``transformers``' ``LlamaConfig``,
converted with the converter in llama-cpp-python 0.3.36's sdist
(``vendor/llama.cpp/convert_hf_to_gguf.py``; ``scripts/engines/llamacpp.sh`` unpacks it and
names it in ``KVSTRATA_LLAMACPP_CONVERTER``). Built once per shape into a cache folder."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

_TEXT = (
    "the project cache keeps context warm so follow up questions start at once even after "
    "a restart of the process kvstrata stores key value states in chunks under prefix hashes "
    "llama cpp reads them back and computes only the rest of the prompt"
)
WORDS = _TEXT.split(" ")


@dataclass(frozen=True)
class Shape:
    vocab: int = 320
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 128
    ctx: int = 4096
    seed: int = 0

    @property
    def name(self) -> str:
        return (
            f"llama-v{self.vocab}-h{self.hidden}-L{self.layers}-a{self.heads}"
            f"-kv{self.kv_heads}-f{self.ffn}-c{self.ctx}-s{self.seed}"
        )


def converter() -> Path:
    """The sdist's converter: ``KVSTRATA_LLAMACPP_CONVERTER``, else where
    ``scripts/engines/llamacpp.sh`` unpacks it."""
    default = (
        Path(os.environ.get("KVSTRATA_WHEEL_DIR", Path.home() / ".cache/kvstrata/wheels"))
        / "llama_cpp_python-0.3.36-src/vendor/llama.cpp/convert_hf_to_gguf.py"
    )
    path = Path(os.environ.get("KVSTRATA_LLAMACPP_CONVERTER") or default)
    if not path.is_file():
        raise RuntimeError(
            f"no converter at {path}: run scripts/engines/llamacpp.sh --install-only"
        )
    return path


def corpus(n_lines: int = 2000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 20))) for _ in range(n_lines)]


def build_gguf(cache_dir: Path, shape: Shape = Shape()) -> Path:
    """The GGUF file of ``shape`` under ``cache_dir`` (built when missing)."""
    out = cache_dir / f"{shape.name}.gguf"
    if out.is_file():
        return out
    script = converter()
    import sentencepiece as spm
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = cache_dir / f"{shape.name}-hf"
    hf.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus(seed=shape.seed)),
        model_prefix=str(hf / "tokenizer"),
        vocab_size=shape.vocab,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.ctx,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(shape.seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger than the init's 0.02 so the logits are far from uniform
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(hf)
    tmp = out.with_suffix(".tmp")
    subprocess.run(
        [sys.executable, str(script), str(hf), "--outfile", str(tmp), "--outtype", "f16"],
        check=True,
        capture_output=True,
    )
    tmp.replace(out)
    return out
