"""A tiny Llama for SGLang's real server, made on the spot (no downloads): random weights from a
fixed seed saved with ``save_pretrained``, and a word-level tokenizer trained here with
``tokenizers`` (one token per word ``w0`` … ``w{VOCAB-1}``, so a prompt of N words is N tokens and
the tests can size prompts in pages exactly).

Run as ``python -m tests.engines.sglang_server.tiny_model DIR`` to write it (the benchmark does).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

#: Words in the vocabulary besides the special tokens.
VOCAB = 480
SPECIALS = ["<unk>", "<s>", "</s>"]
SEED = 24


def words(n: int, seed: int) -> str:
    """A prompt of exactly ``n`` tokens (one word each), reproducible from ``seed``."""
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(VOCAB)}" for _ in range(n))


def write_model(path: Path, hidden: int = 64, layers: int = 2, intermediate: int = 128) -> Path:
    """Write the model and tokenizer into ``path`` (once; reused when already there). The
    default is tiny (2 layers, 4 query and 2 KV heads of 16); the serving benchmark asks for a
    wider one (heads of 64), so that prefill costs what a KV load saves."""
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIALS, vocab_size=VOCAB + len(SPECIALS))
    tok.train_from_iterator([" ".join(f"w{i}" for i in range(VOCAB))], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(path)

    torch.manual_seed(SEED)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=max(4, hidden // 64),
        num_key_value_heads=2,
        vocab_size=len(fast),
        max_position_embeddings=4096,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


if __name__ == "__main__":
    print(write_model(Path(sys.argv[1])))
