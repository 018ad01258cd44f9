"""CLI: prune --method wanda|sparsegpt with --calib, recipes, finetune and analyze."""

from __future__ import annotations

import json

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
