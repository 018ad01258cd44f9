"""Wanda and SparseGPT through prune_checkpoint on a tiny BERT: output format, exact sparsity, block order."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from prunekit.errors import PatternError
from prunekit.io import open_checkpoint
from prunekit.prune import prune_checkpoint
from prunekit.prune.calibration import LayerStats, build_hf_model, prune_model, tokenize
from prunekit.prune.criteria import rowwise_mask, wanda
from prunekit.prune.patterns import NM, Block, Unstructured, parse_pattern

from ..conftest import tree_digest

TEXTS = [
    "Sparse networks keep only a few weights.",
    "The quick brown fox jumps over the lazy dog.",
    "Return the number of items in a container.",
    "Open the file and read its lines, one at a time.",
    "A tokenizer splits text into pieces.",
    "Layers run one after another in order.",
]


@pytest.mark.parametrize(
    "method,pattern,sparsity",
    [("wanda", "unstructured", 0.5), ("sparsegpt", "2:4", None), ("sparsegpt", "block:4x4", 0.5)],
)
def test_calibrated_prune_writes_same_kind_with_exact_patterns(tmp_path, tiny_bert_tok, method, pattern, sparsity):
    before = tree_digest(tiny_bert_tok)
    out = tmp_path / "out"
    result = prune_checkpoint(tiny_bert_tok, out, pattern, sparsity, method, calibration=TEXTS)
    assert len(result.pruned) == 12  # 2 layers x (q, k, v, attn out, intermediate, output)
    pat = parse_pattern(pattern)
    target = pat.check_sparsity(sparsity)
    pruned = open_checkpoint(out)
    source = open_checkpoint(tiny_bert_tok)
    sidecar = json.loads((out / "prunekit.json").read_text())
    assert set(sidecar["tensors"]) == {t.name for t in result.pruned}
    for name in pruned.names():
        tensor = pruned.get(name)
        if name in sidecar["tensors"]:
            keep = tensor != 0
            assert pat.is_valid(keep), name
            assert int((~keep).sum()) == int((~pat.mask(tensor.abs(), target)).sum())  # exact count
            assert sidecar["tensors"][name]["method"] == method
            assert sidecar["tensors"][name]["sparsity"] == pytest.approx(target)
        else:
            assert torch.equal(tensor, source.get(name)), name
    assert (out / "vocab.txt").is_file() and (out / "config.json").is_file()
    assert tree_digest(tiny_bert_tok) == before


def test_sparsegpt_changes_kept_weights_and_wanda_does_not(tmp_path, tiny_bert_tok):
    source = open_checkpoint(tiny_bert_tok)
    name = "encoder.layer.1.intermediate.dense.weight"
    for method in ("wanda", "sparsegpt"):
        prune_checkpoint(tiny_bert_tok, tmp_path / method, "2:4", None, method, calibration=TEXTS)
        pruned = open_checkpoint(tmp_path / method).get(name)
        kept = pruned != 0
        same = torch.equal(pruned[kept], source.get(name)[kept])
        assert same == (method == "wanda")


def test_calibration_file_and_default_corpus(tmp_path, tiny_bert_tok):
    calib = tmp_path / "calib.jsonl"
    calib.write_text("\n".join(json.dumps({"text": t}) for t in TEXTS) + "\n")
    a = prune_checkpoint(tiny_bert_tok, tmp_path / "a", "unstructured", 0.5, "wanda", calibration=calib)
    b = prune_checkpoint(tiny_bert_tok, tmp_path / "b", "unstructured", 0.5, "wanda", calibration=TEXTS)
    assert torch.equal(
        open_checkpoint(tmp_path / "a").get(a.pruned[0].name), open_checkpoint(tmp_path / "b").get(b.pruned[0].name)
    )
    prune_checkpoint(tiny_bert_tok, tmp_path / "c", "unstructured", 0.5, "wanda", calib_samples=4)
    assert (tmp_path / "c" / "prunekit.json").is_file()


def test_calibrated_methods_need_an_hf_directory(tmp_path, mlp_safetensors):
    for method in ("wanda", "sparsegpt"):
        with pytest.raises(PatternError, match="needs a Hugging Face model directory"):
            prune_checkpoint(mlp_safetensors, tmp_path / "out.safetensors", "2:4", None, method)
    assert not list(tmp_path.glob("out*"))


def test_block_inputs_come_from_the_already_pruned_blocks(tiny_bert_tok):
    # Wanda's statistics for layer 1 must be measured with layer 0 already pruned.
    model = build_hf_model(tiny_bert_tok)
    reference = build_hf_model(tiny_bert_tok)
    batches = tokenize(tiny_bert_tok, TEXTS)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and "encoder" in n}
    masks = prune_model(model, {n: (Unstructured(), 0.5) for n in linears}, "wanda", batches)
    ref_modules = dict(reference.named_modules())
    with torch.no_grad():
        for n in linears:
            if n.startswith("encoder.layer.0."):
                ref_modules[n].weight.mul_(masks[n])
        stats, current = {}, {}
        for n in linears:
            if n.startswith("encoder.layer.1."):
                st = stats[n] = LayerStats(torch.zeros(ref_modules[n].in_features))
                ref_modules[n].register_forward_pre_hook(lambda mod, args, st=st: st.add(args[0], current["mask"]))
        for batch in batches:
            current["mask"] = batch["attention_mask"].bool()
            reference(**batch)
    for n, st in stats.items():
        expected = rowwise_mask(wanda(ref_modules[n].weight, st.input_norm), 0.5)
        assert torch.equal(masks[n], expected), n


def test_prune_model_without_blocks_and_with_nm_and_block_patterns():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)).eval()

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, x):
            return self.net(x)

    batches = [{"x": torch.randn(5, 8)} for _ in range(4)]
    targets = {"net.0": (NM(2, 4), 0.5), "net.2": (Block(4, 4), 0.5)}
    masks = prune_model(Wrap(), targets, "sparsegpt", batches)
    assert NM(2, 4).is_valid(masks["net.0"]) and Block(4, 4).is_valid(masks["net.2"])
    assert bool((model[2].weight[~masks["net.2"]] == 0).all())


def test_padding_tokens_do_not_enter_the_statistics(tiny_bert_tok):
    model = build_hf_model(tiny_bert_tok)
    linear = model.encoder.layer[1].intermediate.dense
    results = []
    for batch_size in (1, 4):
        batches = tokenize(tiny_bert_tok, TEXTS, batch_size=batch_size)
        st, current = LayerStats(torch.zeros(32), torch.zeros(32, 32)), {}
        handle = linear.register_forward_pre_hook(lambda mod, args, st=st, cur=current: st.add(args[0], cur["mask"]))
        with torch.no_grad():
            for batch in batches:
                current["mask"] = batch["attention_mask"].bool()
                model(**batch)
        handle.remove()
        results.append(st)
    one, padded = results
    assert one.tokens == padded.tokens  # the same real tokens, no padding counted
    assert any(int((b["attention_mask"] == 0).sum()) for b in tokenize(tiny_bert_tok, TEXTS, batch_size=4))
    torch.testing.assert_close(padded.sq_sum, one.sq_sum, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(padded.hessian, one.hessian, rtol=1e-4, atol=1e-4)
