"""Mixed precision in fine-tuning, on the CPU: bf16 autocast, fp16 with loss scaling, float32 weights, exact masks."""

from __future__ import annotations

import pytest
import torch

from prunekit.errors import PrunekitError
from prunekit.prune.finetune import _amp_dtype, finetune_checkpoint, state_path
from prunekit.recipes import RecipeError, parse_recipe

from .test_finetune import GMP_RECIPE, TEXTS


def _check_states(out, seen):
    def check(done, total, loss):
        if done == total:
            return
        state = torch.load(state_path(out), weights_only=True)
        for name, keep in state["masks"].items():
            weight = state["model"][f"{name}.weight"]
            assert weight.dtype == torch.float32, name  # autocast never changes the stored weights
            assert bool((weight[~keep] == 0).all()), (done, name)
        seen.append(state)

    return check


def test_precision_auto_is_bf16_on_cuda_and_fp32_on_cpu():
    assert _amp_dtype("auto", torch.device("cpu")) is None
    assert _amp_dtype("fp32", torch.device("cpu")) is None
    assert _amp_dtype("bf16", torch.device("cpu")) is torch.bfloat16
    assert _amp_dtype("fp16", torch.device("cpu")) is torch.float16
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        assert _amp_dtype("auto", torch.device("cuda")) is torch.bfloat16


def test_bf16_autocast_keeps_float32_weights_and_exact_masks(tmp_path, tiny_bert_tok):
    recipe = parse_recipe(GMP_RECIPE)
    fp32 = finetune_checkpoint(tiny_bert_tok, recipe, tmp_path / "fp32", data=TEXTS, device="cpu")
    seen = []
    out = tmp_path / "bf16"
    bf16 = finetune_checkpoint(
        tiny_bert_tok, recipe, out, data=TEXTS, device="cpu", precision="bf16", progress=_check_states(out, seen)
    )
    assert (fp32.precision, bf16.precision) == ("fp32", "bf16")
    assert len(seen) == 5 and all(s["scaler"] is None for s in seen)  # bf16 needs no loss scaling
    assert all(torch.isfinite(torch.tensor(bf16.losses)))
    assert bf16.losses != fp32.losses  # the forward pass did run in bfloat16
    assert max(abs(a - b) for a, b in zip(bf16.losses, fp32.losses)) < 0.1


def test_fp16_uses_a_loss_scaler_that_is_saved_and_resumed(tmp_path, tiny_bert_tok):
    recipe = parse_recipe(GMP_RECIPE.replace("checkpoint_every: 1", "checkpoint_every: 2"))
    full = finetune_checkpoint(tiny_bert_tok, recipe, tmp_path / "full", data=TEXTS, device="cpu", precision="fp16")
    assert full.precision == "fp16" and all(torch.isfinite(torch.tensor(full.losses)))

    def kill_at_3(done, total, loss):
        if done == 3:
            raise KeyboardInterrupt

    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        finetune_checkpoint(tiny_bert_tok, recipe, out, data=TEXTS, device="cpu", precision="fp16", progress=kill_at_3)
    state = torch.load(state_path(out), weights_only=True)
    assert state["step"] == 2 and state["scaler"]["scale"] > 0
    # A state written in fp16 is not resumed in another precision (the recipe differs).
    with pytest.raises(PrunekitError, match="another recipe"):
        finetune_checkpoint(tiny_bert_tok, recipe, out, data=TEXTS, device="cpu", resume=True)
    resumed = finetune_checkpoint(tiny_bert_tok, recipe, out, data=TEXTS, device="cpu", precision="fp16", resume=True)
    assert resumed.resumed_from == 2 and resumed.losses == full.losses[2:]


def test_unknown_precision_is_a_recipe_error(tmp_path, tiny_bert_tok):
    with pytest.raises(RecipeError, match="unknown precision 'fp8'"):
        finetune_checkpoint(tiny_bert_tok, parse_recipe(GMP_RECIPE), tmp_path / "out", data=TEXTS, precision="fp8")
    with pytest.raises(RecipeError, match=r"<recipe>:\d+: finetune.precision"):
        parse_recipe(GMP_RECIPE.replace("  checkpoint_every: 1\n", "  checkpoint_every: 1\n  precision: half\n"))
    assert not (tmp_path / "out").exists()
