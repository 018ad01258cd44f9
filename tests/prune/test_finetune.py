"""Fine-tuning: exact masks after every step, the GMP schedule, kill-and-resume bit-identical, outputs."""

from __future__ import annotations

import json

import pytest
import torch

from prunekit.errors import PrunekitError
from prunekit.io import open_checkpoint
from prunekit.prune.finetune import finetune_checkpoint, state_path
from prunekit.recipes import gmp_sparsity, parse_recipe, recipes_dir

from ..conftest import tree_digest

GMP_RECIPE = """
name: test-gmp
prune:
  method: magnitude
  targets:
    - regex: "intermediate|output"
      pattern: block:4x4
      sparsity: 0.5
    - pattern: unstructured
      sparsity: 0.75
  schedule: {kind: gmp, start_step: 1, end_step: 5, frequency: 2}
finetune:
  steps: 6
  batch_size: 4
  max_length: 24
  checkpoint_every: 1
  optimizer: {name: adamw, lr: 1.0e-3, weight_decay: 0.01}
  lr_schedule: {name: linear, warmup_steps: 2}
distillation: {loss: cosine, hidden_mse_weight: 0.5}
"""

TEXTS = [f"sentence number {i} talks about {w}" for i, w in enumerate("cats dogs trees rivers code maths tea".split())]


def _tensors(path):
    ckpt = open_checkpoint(path)
    return {name: ckpt.get(name) for name in ckpt.names()}


def test_masks_are_exact_after_every_step_and_follow_the_cubic_schedule(tmp_path, tiny_bert_tok):
    recipe = parse_recipe(GMP_RECIPE)
    out = tmp_path / "out"
    seen = []

    def check(done, total, loss):
        if done == total:  # the last step writes the output instead of a state
            return
        state = torch.load(state_path(out), weights_only=True)
        assert state["step"] == done
        for name, keep in state["masks"].items():
            weight = state["model"][f"{name}.weight"]
            assert bool((weight[~keep] == 0).all()), (done, name)
            is_block = "intermediate" in name or "output" in name
            expected = gmp_sparsity(done - 1, recipe.prune.schedule, 0.5 if is_block else 0.75)
            unit = 16 if is_block else 1  # block:4x4 prunes whole tiles
            assert int((~keep).sum()) == round(expected * keep.numel() / unit) * unit, (done, name)
        seen.append(done)

    before = tree_digest(tiny_bert_tok)
    finetune_checkpoint(tiny_bert_tok, recipe, out, data=TEXTS, progress=check)
    assert seen == [1, 2, 3, 4, 5]
    assert tree_digest(tiny_bert_tok) == before


def test_gmp_output_has_exact_final_patterns_and_sidecar(tmp_path, tiny_bert_tok):
    out = tmp_path / "out"
    result = finetune_checkpoint(tiny_bert_tok, parse_recipe(GMP_RECIPE), out, data=TEXTS)
    assert len(result.losses) == 6 and all(torch.isfinite(torch.tensor(result.losses)))
    sidecar = json.loads((out / "prunekit.json").read_text())
    assert len(sidecar["tensors"]) == 12
    tensors, source = _tensors(out), _tensors(tiny_bert_tok)
    for name, entry in sidecar["tensors"].items():
        assert entry["method"] == "gmp+distill"
        zeros = int((tensors[name] == 0).sum())
        if "intermediate" in name or "output" in name:
            assert entry["pattern"] == "block:4x4"
            keep = tensors[name] != 0
            blocks = keep.reshape(keep.shape[0] // 4, 4, keep.shape[1] // 4, 4).sum(dim=(1, 3))
            assert bool(((blocks == 0) | (blocks == 16)).all())
            assert int((blocks == 0).sum()) == round(0.5 * blocks.numel())
        else:
            assert entry["pattern"] == "unstructured" and zeros == round(0.75 * tensors[name].numel())
    changed = [n for n in source if not torch.equal(source[n], tensors[n])]
    assert "embeddings.word_embeddings.weight" in changed  # dense weights are trained too
    assert not state_path(out).parent.exists()  # the training state is removed once the output is written


def test_kill_and_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path, tiny_bert_tok):
    text = GMP_RECIPE.replace("checkpoint_every: 1", "checkpoint_every: 2")
    recipe = parse_recipe(text)
    full = finetune_checkpoint(tiny_bert_tok, recipe, tmp_path / "full", data=TEXTS)

    def kill_at_3(done, total, loss):
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        finetune_checkpoint(tiny_bert_tok, recipe, tmp_path / "resumed", data=TEXTS, progress=kill_at_3)
    assert not (tmp_path / "resumed").exists()
    assert torch.load(state_path(tmp_path / "resumed"), weights_only=True)["step"] == 2
    resumed = finetune_checkpoint(tiny_bert_tok, recipe, tmp_path / "resumed", data=TEXTS, resume=True)
    assert resumed.resumed_from == 2
    assert resumed.losses == full.losses[2:]
    a, b = _tensors(tmp_path / "full"), _tensors(tmp_path / "resumed")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_resume_refuses_a_state_of_another_recipe(tmp_path, tiny_bert_tok):
    recipe = parse_recipe(GMP_RECIPE.replace("checkpoint_every: 1", "checkpoint_every: 2"))

    def kill(done, total, loss):
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        finetune_checkpoint(tiny_bert_tok, recipe, tmp_path / "out", data=TEXTS, progress=kill)
    other = parse_recipe(GMP_RECIPE.replace("lr: 1.0e-3", "lr: 2.0e-3"))
    with pytest.raises(PrunekitError, match="another recipe"):
        finetune_checkpoint(tiny_bert_tok, other, tmp_path / "out", data=TEXTS, resume=True)


def test_oneshot_recipe_without_training_prunes_with_its_method(tmp_path, tiny_bert_tok):
    shipped = (recipes_dir() / "2of4-oneshot-sparsegpt.yaml").read_text()
    recipe = parse_recipe(shipped.replace("calibration_samples: 128", "calibration_samples: 8"))
    result = finetune_checkpoint(tiny_bert_tok, recipe, tmp_path / "out")
    assert result.losses == [] and len(result.pruned) == 12
    sidecar = json.loads((tmp_path / "out" / "prunekit.json").read_text())
    assert {t["method"] for t in sidecar["tensors"].values()} == {"sparsegpt"}
    assert {t["pattern"] for t in sidecar["tensors"].values()} == {"2:4"}


def test_finetune_needs_an_hf_directory(tmp_path, mlp_safetensors):
    with pytest.raises(PrunekitError, match="needs a Hugging Face model directory"):
        finetune_checkpoint(mlp_safetensors, "unstructured-90-gmp-distill", tmp_path / "out", steps=2)
