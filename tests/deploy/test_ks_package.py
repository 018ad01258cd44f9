"""Kronecker-sparse layers through the whole path: prune (projection) or factorize (chains) -> convert -> export ->
load -> run, against the dense product; the report's ks bytes; the CLI."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from typer.testing import CliRunner

from prunekit.deploy.convert import candidate_formats, convert_checkpoint, pattern_params
from prunekit.deploy.export import export_package
from prunekit.deploy.report import build_report, render_markdown
from prunekit.deploy.runtime import SparseLinear, load, run
from prunekit.formats import decode, encode
from prunekit.formats.ks import encode_factors
from prunekit.io import open_checkpoint
from prunekit.prune import prune_checkpoint, prune_tensor
from prunekit.prune.kronecker import chain_product, factorize_checkpoint
from prunekit.prune.patterns import KroneckerSparse

TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float64: 1e-12}
SINGLE = "ks:2,8,4,4"  # (64, 32)
CHAIN = "ks:2,8,2,4/4,4,8,1"  # (64, 16) @ (16, 32)


def ks_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "fc1.weight": torch.randn(64, 32, generator=g),
        "fc1.bias": torch.randn(64, generator=g),
        "fc2.weight": torch.randn(48, 64, generator=g),
        "fc2.bias": torch.randn(48, generator=g),
    }


@pytest.fixture
def ks_safetensors(tmp_path):
    path = tmp_path / "ks.safetensors"
    save_file(ks_state(), str(path))
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_sparse_linear_ks_single_and_chain_match_float64_linear(dtype):
    g = torch.Generator().manual_seed(0)
    pat = KroneckerSparse(2, 8, 4, 4)
    w = prune_tensor(torch.randn(64, 32, generator=g).to(dtype), pat, pat.check_sparsity(None))
    factors = [torch.randn(2, 4, 8, 2, generator=g).to(dtype), torch.randn(4, 1, 4, 8, generator=g).to(dtype)]
    bias = torch.randn(64, generator=g).to(dtype)
    x = torch.randn(2, 5, 32, generator=g).to(dtype)
    for enc, dense in (
        (encode("ks", w, pattern_params(SINGLE)), w.double()),
        (encode_factors(factors), chain_product(factors)),
    ):
        layer = SparseLinear(enc, bias)
        out = layer(x)
        ref = F.linear(x.double(), dense, bias.double())
        assert out.shape == (2, 5, 64) and out.dtype == dtype
        assert float((out.double() - ref).norm() / ref.norm()) < TOLERANCE[dtype]
        assert layer.encoded().format == "ks"


def test_auto_stores_ks_patterns_in_the_ks_format():
    assert candidate_formats(SINGLE, "auto")[0] == "ks"
    assert candidate_formats(CHAIN, "auto") == ["ks"]
    assert pattern_params(SINGLE) == {"a": 2, "b": 8, "c": 4, "d": 4, "patterns": "2,8,4,4"}
    assert pattern_params(CHAIN) == {"patterns": "2,8,2,4/4,4,8,1"}


def test_pruned_ks_package_runs_like_the_masked_weights(tmp_path, ks_safetensors):
    pruned, package = tmp_path / "p.safetensors", tmp_path / "pkg"
    result = prune_checkpoint(ks_safetensors, pruned, SINGLE)
    assert [t.name for t in result.pruned] == ["fc1.weight"]
    assert result.pruned[0].sparsity == pytest.approx(1 - 1 / 8)
    export_package(pruned, package)
    manifest = json.loads((package / "manifest.json").read_text())
    entry = next(e for e in manifest["tensors"] if e["name"] == "fc1.weight")
    assert entry["format"] == "ks" and entry["nbytes"] == 2 * 8 * 4 * 4 * 4
    ckpt = open_checkpoint(pruned)
    x = torch.randn(7, 32)
    out = run(load(package), inputs={"fc1": x})
    torch.testing.assert_close(out["fc1"], F.linear(x, ckpt.get("fc1.weight"), ckpt.get("fc1.bias")))
    report = build_report(package)
    row = next(r for r in report.rows if r.name == "fc1.weight")
    assert row.stored_format == "ks" and row.format_nbytes["ks"] == entry["nbytes"]
    assert row.format_nbytes["csr"] > row.format_nbytes["ks"]
    assert "| ks |" in render_markdown(report).splitlines()[4]


def test_factorized_chain_package_runs_like_the_dense_product(tmp_path, ks_safetensors):
    fact, package = tmp_path / "f.safetensors", tmp_path / "pkg"
    result = factorize_checkpoint(ks_safetensors, fact, CHAIN, sweeps=2)
    assert set(result.errors) == {"fc1.weight"}
    converted = convert_checkpoint(fact, tmp_path / "c.safetensors")
    entry = next(e for e in converted.entries if e.name == "fc1.weight")
    assert entry.format == "ks" and entry.params == {"patterns": "2,8,2,4/4,4,8,1"}
    assert entry.nbytes == (2 * 8 * 2 * 4 + 4 * 4 * 8) * 4 < entry.dense_nbytes
    export_package(fact, package)
    ckpt = open_checkpoint(fact)
    x = torch.randn(9, 32)
    loaded = load(package)
    out = run(loaded, inputs={"fc1": x})
    ref = F.linear(x.double(), ckpt.get("fc1.weight").double(), ckpt.get("fc1.bias").double())
    assert float((out["fc1"].double() - ref).norm() / ref.norm()) < 1e-5
    stored = decode(loaded.model.layer("fc1").encoded())
    assert float((stored - ckpt.get("fc1.weight")).norm() / ckpt.get("fc1.weight").norm()) < 1e-5
    row = next(r for r in build_report(package).rows if r.name == "fc1.weight")
    assert row.stored_format == "ks" and row.format_nbytes["ks"] == entry.nbytes


def test_a_weight_that_is_not_a_chain_product_falls_back_to_dense(tmp_path, ks_safetensors):
    from prunekit.deploy.convert import encode_best

    enc, reason = encode_best(torch.randn(64, 32), CHAIN, "auto")
    assert enc.format == "dense" and "not a product" in reason


def test_cli_prune_ks_and_factorize(tmp_path, ks_safetensors):
    from prunekit.cli import app
    from prunekit.cli_ks import app as ks_app

    runner = CliRunner()
    res = runner.invoke(app, ["prune", str(ks_safetensors), "-o", str(tmp_path / "p.safetensors"), "--pattern", SINGLE])
    assert res.exit_code == 0, res.output
    pruned = open_checkpoint(tmp_path / "p.safetensors").get("fc1.weight")
    assert KroneckerSparse(2, 8, 4, 4).is_valid(pruned != 0)
    res = runner.invoke(app, ["prune", str(ks_safetensors), "-o", str(tmp_path / "q.safetensors"), "--pattern", CHAIN])
    assert res.exit_code != 0 and "prunekit ks factorize" in res.output
    assert not (tmp_path / "q.safetensors").exists()
    res = runner.invoke(
        ks_app, ["factorize", str(ks_safetensors), "-o", str(tmp_path / "f.safetensors"), "-p", CHAIN, "--sweeps", "1"]
    )
    assert res.exit_code == 0, res.output
    assert "fc1.weight" in res.output and (tmp_path / "f.safetensors").exists()
    res = runner.invoke(ks_app, ["factorize", str(ks_safetensors), "-o", str(tmp_path / "g"), "-p", "ks:1,2,3"])
    assert res.exit_code != 0 and "four integers" in res.output
