"""A tiny Llama-shaped model with random weights and a word-level tokenizer trained here, saved
as a local folder vLLM loads like any checkpoint (no hub download, no network).

Every word of :data:`WORDS` is one token, so a prompt of ``n`` words is exactly ``n`` prompt
tokens: the tests and the benchmark size prompts in blocks without asking a tokenizer. The
weights come from a fixed seed; another seed (or dtype) is another model for kvstrata.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

__all__ = ["WORDS", "build_tiny_llama", "prompt_words"]

_SYLLABLES = ("ka", "lo", "mi", "su", "te", "ra", "no", "vi", "pe", "du", "zo", "fa")
WORDS: tuple[str, ...] = tuple(
    "".join(p) for p in itertools.islice(itertools.product(_SYLLABLES, repeat=3), 600)
)
SPECIAL = ("<unk>", "<s>", "</s>")

# wide enough that a 2k-token prefill costs about a second on 2 cores, so a cache hit is
# visible in TTFT; head size 64 (vLLM's CPU attention takes it)
LLAMA = {
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
}


def _train_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=list(SPECIAL), min_frequency=1)
    rng = random.Random(0)
    sentences = [" ".join(WORDS)] + [" ".join(rng.choices(WORDS, k=12)) for _ in range(200)]
    tok.train_from_iterator(sentences, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        model_max_length=LLAMA["max_position_embeddings"],
    )  # fmt: skip
    fast.save_pretrained(folder)


def build_tiny_llama(folder: Path, seed: int = 0, dtype: str = "float32") -> Path:
    """Write the model (weights from ``seed``, stored in ``dtype``) and its tokenizer to
    ``folder``; a folder already holding this exact model is reused."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    stamp = json.dumps({"seed": seed, "dtype": dtype, **LLAMA}, sort_keys=True)
    marker = folder / "kvstrata-tiny.json"
    if marker.exists() and marker.read_text() == stamp:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    _train_tokenizer(folder)
    vocab = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"])
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False, **LLAMA,
    )  # fmt: skip
    model: Any = LlamaForCausalLM(config)
    model.to(getattr(torch, dtype)).save_pretrained(folder, safe_serialization=True)
    marker.write_text(stamp)
    return folder


def prompt_words(n: int, seed: int) -> str:
    """``n`` words (= ``n`` tokens) drawn from ``seed``: distinct seeds, distinct prefixes."""
    rng = random.Random(seed)
    return " ".join(rng.choices(WORDS, k=n))
