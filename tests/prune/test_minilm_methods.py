"""On the real all-MiniLM-L6-v2: Wanda and SparseGPT keep held-out embeddings closer to dense than magnitude."""

from __future__ import annotations

import pytest
import torch

from prunekit.data import evaluation_texts
from prunekit.deploy.runtime import run_hf
from prunekit.prune import prune_checkpoint

pytestmark = pytest.mark.slow


def _embed(path, texts):
    import transformers

    model = transformers.AutoModel.from_pretrained(path).eval()
    return run_hf(model, path, texts)["sentence_embedding"]


def test_calibrated_methods_beat_magnitude_at_2of4_on_held_out_text(tmp_path, minilm_dir):
    texts = evaluation_texts(32)
    dense = _embed(minilm_dir, texts)
    cosine = {}
    for method in ("magnitude", "wanda", "sparsegpt"):
        out = tmp_path / method
        result = prune_checkpoint(minilm_dir, out, "2:4", None, method, calib_samples=16)
        assert len(result.pruned) == 36 and all(t.sparsity == 0.5 for t in result.pruned)
        cosine[method] = float(torch.nn.functional.cosine_similarity(dense, _embed(out, texts)).mean())
    assert cosine["magnitude"] < cosine["wanda"] < cosine["sparsegpt"], cosine
