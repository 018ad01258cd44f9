"""Fixtures for pruning with calibration data: a tiny BERT that has a tokenizer."""

from __future__ import annotations

import shutil
import string
from pathlib import Path

import pytest


def write_char_tokenizer(directory: Path) -> None:
    """Save a character-level WordPiece tokenizer (fits the tiny BERT's 120-token vocabulary)."""
    transformers = pytest.importorskip("transformers")
    chars = list(string.ascii_lowercase + string.digits) + list(".,;:'\"()-_/")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *(f"##{c}" for c in string.ascii_lowercase)]
    vocab_file = directory / "vocab.txt"
    vocab_file.write_text("\n".join(vocab) + "\n")
    transformers.BertTokenizer(str(vocab_file), model_max_length=64).save_pretrained(directory)


@pytest.fixture
def tiny_bert_tok(tmp_path: Path, tiny_bert_dir: Path) -> Path:
    """The conftest tiny BERT (2 layers, hidden 32) plus a tokenizer, in its own directory."""
    out = tmp_path / "tiny-bert-tok"
    shutil.copytree(tiny_bert_dir, out)
    write_char_tokenizer(out)
    return out
