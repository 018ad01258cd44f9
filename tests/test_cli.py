"""CLI behaviour: the happy path, and every bad input giving one line, a non-zero exit and no output."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from prunekit.cli import app

from .conftest import mlp_state, tree_digest

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def assert_clean_failure(result, match: str, tmp_path=None, inputs=(), digests=()):
    assert result.exit_code not in (0, None), result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert match in lines[0], lines[0]
    for path, digest in zip(inputs, digests):
        assert tree_digest(path) == digest
    if tmp_path is not None:
        assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or p.name.startswith("out")]


@pytest.mark.parametrize("command", ["prune", "convert", "export", "run", "report", "demo"])
def test_every_command_has_help(command):
    result = invoke(command, "--help")
    assert result.exit_code == 0
    assert "Usage" in result.output


def test_prune_convert_export_run_report_on_a_state_dict(tmp_path, mlp_safetensors):
    before = tree_digest(mlp_safetensors)
    pruned = tmp_path / "pruned.safetensors"
    assert (
        invoke("prune", mlp_safetensors, "-o", pruned, "--pattern", "unstructured", "--sparsity", "0.6").exit_code == 0
    )
    sidecar = json.loads((tmp_path / "pruned.safetensors.prunekit.json").read_text())
    assert set(sidecar["tensors"]) == {"fc1.weight", "fc2.weight", "conv.weight"}
    assert all(t["method"] == "magnitude" and t["pattern"] == "unstructured" for t in sidecar["tensors"].values())
    result = invoke("convert", pruned, "-o", tmp_path / "c.safetensors", "--format", "csr")
    assert result.exit_code == 0, result.output
    assert "csr" in result.output
    assert invoke("export", pruned, "-o", tmp_path / "pkg").exit_code == 0
    assert (tmp_path / "pkg" / "REPORT.md").read_text().startswith("# Memory report")
    save_file({"fc1": torch.randn(3, 32)}, str(tmp_path / "x.safetensors"))
    result = invoke("run", tmp_path / "pkg", "--input", tmp_path / "x.safetensors", "-o", tmp_path / "y.safetensors")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "y.safetensors").is_file()
    result = invoke("report", tmp_path / "pkg", "--json", tmp_path / "r.json", "--plot", tmp_path / "r.png")
    assert result.exit_code == 0, result.output
    assert len(json.loads((tmp_path / "r.json").read_text())["layers"]) == 3
    assert (tmp_path / "r.png").stat().st_size > 1000
    assert tree_digest(mlp_safetensors) == before


def test_prune_hf_dir_copies_config_and_writes_sidecar(tmp_path, tiny_bert_dir):
    out = tmp_path / "out-hf"
    result = invoke("prune", tiny_bert_dir, "-o", out, "-p", "2:4")
    assert result.exit_code == 0, result.output
    assert (out / "config.json").read_text() == (tiny_bert_dir / "config.json").read_text()
    assert (out / "model.safetensors").is_file() and (out / "prunekit.json").is_file()


def test_missing_checkpoint(tmp_path):
    result = invoke("prune", tmp_path / "nope.safetensors", "-o", tmp_path / "out.safetensors", "-p", "2:4")
    assert_clean_failure(result, "not found", tmp_path)


def test_truncated_safetensors(tmp_path, mlp_safetensors):
    data = mlp_safetensors.read_bytes()
    mlp_safetensors.write_bytes(data[:-64])
    digest = tree_digest(mlp_safetensors)
    result = invoke("prune", mlp_safetensors, "-o", tmp_path / "out.safetensors", "-p", "2:4")
    assert_clean_failure(result, "truncated", tmp_path, [mlp_safetensors], [digest])


def test_corrupt_safetensors(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00this is not json")
    result = invoke("prune", bad, "-o", tmp_path / "out.safetensors", "-p", "2:4")
    assert_clean_failure(result, "corrupt", tmp_path)


class Exploit:
    def __reduce__(self):
        return (eval, ("1+1",))


def test_pickle_refused_by_weights_only(tmp_path):
    evil = tmp_path / "evil.bin"
    with open(evil, "wb") as f:
        pickle.dump({"fc.weight": Exploit()}, f)
    result = invoke("prune", evil, "-o", tmp_path / "out.bin", "-p", "2:4")
    assert_clean_failure(result, "weights_only", tmp_path)


@pytest.mark.parametrize(
    "args,match",
    [
        (["-p", "diagonal", "-s", "0.5"], "unknown pattern"),
        (["-p", "unstructured", "-s", "1.0"], "sparsity must be in [0, 1)"),
        (["-p", "unstructured", "-s", "-0.2"], "sparsity must be in [0, 1)"),
        (["-p", "unstructured"], "needs --sparsity"),
        (["-p", "5:4"], "N > M"),
        (["-p", "2:4", "-s", "0.3"], "implies sparsity"),
        (["-p", "3:7"], "nothing to prune"),
        (["-p", "unstructured", "-s", "0.5", "--method", "oracle"], "unknown pruning method"),
        (["-p", "block:32x32", "-s", "0.5", "--include", "fc2"], "cannot take pattern"),
        (["-p", "2:4", "--include", "steps"], "integer tensor"),
        (["-p", "2:4", "--include", "norm"], "1-D tensor"),
        (["-p", "2:4", "--include", "nothing_here"], "matches no tensor"),
        (["-p", "2:4", "--include", "("], "invalid --include regex"),
    ],
)
def test_bad_pruning_requests(tmp_path, mlp_safetensors, args, match):
    digest = tree_digest(mlp_safetensors)
    result = invoke("prune", mlp_safetensors, "-o", tmp_path / "out.safetensors", *args)
    assert_clean_failure(result, match, tmp_path, [mlp_safetensors], [digest])


def test_layers_that_cannot_take_the_pattern_are_skipped_with_a_warning(tmp_path, mlp_safetensors):
    result = invoke("prune", mlp_safetensors, "-o", tmp_path / "out.safetensors", "-p", "block:32x32", "-s", "0.5")
    assert result.exit_code == 0, result.output
    assert "fc2.weight" in result.stderr and "conv.weight" in result.stderr
    sidecar = json.loads((tmp_path / "out.safetensors.prunekit.json").read_text())
    assert list(sidecar["tensors"]) == ["fc1.weight"]
    assert set(sidecar["skipped"]) == {"fc2.weight", "conv.weight"}


def test_existing_output_is_refused_without_overwrite(tmp_path, mlp_safetensors):
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"keep me")
    result = invoke("prune", mlp_safetensors, "-o", out, "-p", "2:4")
    assert result.exit_code == 1 and "already exists" in result.stderr
    assert out.read_bytes() == b"keep me"
    result = invoke("prune", mlp_safetensors, "-o", out, "-p", "2:4", "--overwrite")
    assert result.exit_code == 0, result.output
    assert out.read_bytes() != b"keep me"


def test_output_may_not_overwrite_the_input(tmp_path, mlp_safetensors):
    digest = tree_digest(mlp_safetensors)
    result = invoke("prune", mlp_safetensors, "-o", mlp_safetensors, "-p", "2:4", "--overwrite")
    assert_clean_failure(result, "overlaps the input", None, [mlp_safetensors], [digest])


@pytest.fixture
def package(tmp_path, mlp_safetensors):
    pruned = tmp_path / "p.safetensors"
    assert invoke("prune", mlp_safetensors, "-o", pruned, "-p", "2:4").exit_code == 0
    assert invoke("export", pruned, "-o", tmp_path / "pkg").exit_code == 0
    save_file({"fc1": torch.randn(2, 32)}, str(tmp_path / "x.safetensors"))
    return tmp_path / "pkg"


def test_tampered_package_is_refused(tmp_path, package):
    weights = package / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01
    weights.write_bytes(bytes(data))
    result = invoke("run", package, "--input", tmp_path / "x.safetensors")
    assert_clean_failure(result, "sha256")


def test_package_without_manifest_is_refused(tmp_path, package):
    (package / "manifest.json").unlink()
    result = invoke("run", package, "--input", tmp_path / "x.safetensors")
    assert_clean_failure(result, "manifest.json")


def test_text_input_for_a_state_dict_package_is_refused(package):
    assert_clean_failure(invoke("run", package, "--text", "hello"), "--text needs a Hugging Face text model")
    assert_clean_failure(invoke("run", package), "give --text or --input")


def test_unknown_format_and_existing_package_are_refused(tmp_path, package):
    pruned = tmp_path / "p.safetensors"
    assert_clean_failure(
        invoke("convert", pruned, "-o", tmp_path / "out.safetensors", "-f", "coo"), "unknown format", tmp_path
    )
    assert_clean_failure(invoke("export", pruned, "-o", package), "already exists")


def test_integer_state_dict_prunes_nothing(tmp_path):
    path = tmp_path / "ints.safetensors"
    save_file({"fc.weight": torch.ones(4, 8, dtype=torch.int32)}, str(path))
    assert_clean_failure(
        invoke("prune", path, "-o", tmp_path / "out.safetensors", "-p", "2:4"), "nothing to prune", tmp_path
    )


def test_state_dict_with_conv_and_pt_output_round_trips(tmp_path, mlp_pt):
    out = tmp_path / "out.pt"
    assert invoke("prune", mlp_pt, "-o", out, "-p", "1:4").exit_code == 0
    state = torch.load(out, weights_only=True)
    assert state.keys() == mlp_state().keys()
    conv = state["conv.weight"].reshape(16, -1)
    assert bool(((conv != 0).reshape(16, -1, 4).sum(-1) <= 1).all())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_export_with_kernels_needs_a_gpu(tmp_path, mlp_safetensors):
    pruned = tmp_path / "p.safetensors"
    assert invoke("prune", mlp_safetensors, "-o", pruned, "-p", "2:4").exit_code == 0
    assert_clean_failure(invoke("export", pruned, "-o", tmp_path / "out-pkg", "--kernels"), "unavailable", tmp_path)


@pytest.mark.parametrize("module", ["prunekit", "prunekit.cli"])
def test_python_dash_m_prunekit_runs_the_command(module):
    """``python -m prunekit`` (no console script needed) gives the same command line as ``prunekit``; so does
    ``python -m prunekit.cli``, sub-command groups included (it once failed with a circular import)."""
    import subprocess
    import sys

    for args in (["report", "--help"], ["kernels", "--help"]):
        result = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert "Usage" in result.stdout and args[0] in result.stdout
