"""CLI: prune --method wanda|sparsegpt with --calib, recipes, finetune and analyze."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from prunekit.cli import app

from .conftest import tree_digest
from .prune.conftest import tiny_bert_tok  # noqa: F401 (fixture)
from .test_cli import assert_clean_failure

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_prune_wanda_with_a_calibration_file(tmp_path, tiny_bert_tok):  # noqa: F811
    calib = tmp_path / "calib.txt"
    calib.write_text("The first line of text.\nA second, different line.\n\nA third one.\n")
    out = tmp_path / "out"
    result = invoke(
        "prune", tiny_bert_tok, "-o", out, "-p", "unstructured", "-s", "0.5", "--method", "wanda", "--calib", calib
    )
    assert result.exit_code == 0, result.output
    sidecar = json.loads((out / "prunekit.json").read_text())
    assert {t["method"] for t in sidecar["tensors"].values()} == {"wanda"}


def test_prune_sparsegpt_on_a_state_dict_is_one_line(tmp_path, mlp_safetensors):
    before = tree_digest(mlp_safetensors)
    result = invoke("prune", mlp_safetensors, "-o", tmp_path / "out.safetensors", "-p", "2:4", "--method", "sparsegpt")
    assert_clean_failure(result, "needs a Hugging Face model directory", tmp_path, [mlp_safetensors], [before])


def test_prune_with_a_bad_calibration_file_is_one_line(tmp_path, tiny_bert_tok):  # noqa: F811
    bad = tmp_path / "calib.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "no text field"}\n')
    result = invoke("prune", tiny_bert_tok, "-o", tmp_path / "out", "-p", "2:4", "--method", "wanda", "--calib", bad)
    assert_clean_failure(result, "calib.jsonl:2", tmp_path)
    result = invoke(
        "prune",
        tiny_bert_tok,
        "-o",
        tmp_path / "out",
        "-p",
        "2:4",
        "--method",
        "wanda",
        "--calib",
        tmp_path / "nope.txt",
    )
    assert_clean_failure(result, "not found", tmp_path)
    result = invoke("prune", tiny_bert_tok, "-o", tmp_path / "out", "-p", "2:4", "--method", "obd")
    assert_clean_failure(result, "unknown pruning method", tmp_path)


def test_recipes_list_and_show():
    result = invoke("recipes", "list")
    assert result.exit_code == 0, result.output
    for name in ("unstructured-50-oneshot-wanda", "2of4-oneshot-sparsegpt", "unstructured-90-gmp-distill"):
        assert name in result.stdout
    result = invoke("train", "recipes", "show", "block32-80-gmp-distill")
    assert result.exit_code == 0 and "block:32x32" in result.stdout
    assert_clean_failure(invoke("recipes", "show", "nope"), "unknown recipe")


def test_finetune_command_writes_a_pruned_model(tmp_path, tiny_bert_tok):  # noqa: F811
    data = tmp_path / "train.txt"
    data.write_text("\n".join(f"line {i} of training text about topic {i % 3}" for i in range(12)) + "\n")
    out = tmp_path / "ft"
    result = invoke(
        "finetune", tiny_bert_tok, "--recipe", "unstructured-90-gmp-distill", "-o", out, "--data", data, "--steps", "3"
    )
    assert result.exit_code == 0, result.output
    assert "3 steps" in result.stdout
    sidecar = json.loads((out / "prunekit.json").read_text())
    assert {t["method"] for t in sidecar["tensors"].values()} == {"gmp+distill"}
    assert all(abs(t["sparsity"] - 0.9) < 0.01 for t in sidecar["tensors"].values())
    result = invoke("finetune", tiny_bert_tok, "--recipe", "unstructured-90-gmp-distill", "-o", out, "--steps", "3")
    assert_clean_failure(result, "already exists")


def test_finetune_precision_option_autocasts_and_is_reported(tmp_path, tiny_bert_tok):  # noqa: F811
    data = tmp_path / "train.txt"
    data.write_text("\n".join(f"line {i} of training text about topic {i % 3}" for i in range(12)) + "\n")
    args = ("finetune", tiny_bert_tok, "-r", "unstructured-90-gmp-distill", "--data", data, "--steps", "2")
    result = invoke(*args, "-o", tmp_path / "bf16", "--device", "cpu", "--precision", "bf16")
    assert result.exit_code == 0, result.output
    assert "2 steps (bf16)" in result.stdout
    assert_clean_failure(invoke(*args, "-o", tmp_path / "bad", "--precision", "fp8"), "unknown precision", tmp_path)


def test_finetune_errors_are_one_line(tmp_path, tiny_bert_tok, mlp_safetensors):  # noqa: F811
    assert_clean_failure(
        invoke("finetune", tiny_bert_tok, "-r", "nope", "-o", tmp_path / "out"), "unknown recipe", tmp_path
    )
    result = invoke("finetune", mlp_safetensors, "-r", "unstructured-90-gmp-distill", "-o", tmp_path / "out")
    assert_clean_failure(result, "needs a Hugging Face model directory", tmp_path)


def test_analyze_prints_table_saves_plot_and_allocates(tmp_path, tiny_bert_tok):  # noqa: F811
    data = tmp_path / "held.txt"
    data.write_text("\n".join(f"held-out sentence {i} about things" for i in range(6)) + "\n")
    plot, js = tmp_path / "sens.png", tmp_path / "sens.json"
    result = invoke(
        "analyze",
        tiny_bert_tok,
        "-p",
        "unstructured",
        "--sparsities",
        "0.25,0.5,0.75",
        "--data",
        data,
        "--allocate",
        "0.5",
        "--plot",
        plot,
        "--json",
        js,
    )
    assert result.exit_code == 0, result.output
    assert "intermediate" in result.stdout and "allocated" in result.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads(js.read_text())
    assert len(report["groups"]) == 6 and report["sparsities"] == [0.25, 0.5, 0.75]
    params = {g["name"]: g["params"] for g in report["groups"]}
    mean = sum(report["allocation"][n] * p for n, p in params.items()) / sum(params.values())
    assert mean == pytest.approx(0.5, abs=0.01) and report["allocated_mean"] == pytest.approx(mean)
    for g in report["groups"]:
        assert g["errors"][0] <= g["errors"][-1]  # pruning more hurts more (magnitude, same group)


def test_analyze_errors_are_one_line(tmp_path, tiny_bert_tok, mlp_safetensors):  # noqa: F811
    assert_clean_failure(
        invoke("analyze", mlp_safetensors, "--plot", tmp_path / "p.png"), "needs a Hugging Face model directory"
    )
    assert_clean_failure(invoke("analyze", tiny_bert_tok, "-p", "2:4", "--allocate", "0.5"), "--allocate needs")
    assert_clean_failure(invoke("analyze", tiny_bert_tok, "--sparsities", "a,b"), "comma-separated")
    assert not (tmp_path / "p.png").exists()
