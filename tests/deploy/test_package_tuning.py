"""The package's ``tuning`` record: the cuSPARSELt configuration ids searched at export (``kernels/cslt_tune.py``),
validated in the manifest, staged at load; the CLI's ``--tune`` without a GPU; and on the GPU, export with the search
and a fresh process that runs the 2:4 layer on the stored id without searching."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from prunekit.deploy.export import export_package
from prunekit.deploy.report import build_report
from prunekit.deploy.runtime import load
from prunekit.errors import IntegrityError, KernelUnavailable, PrunekitError
from prunekit.kernels import cslt_tune, structured
from prunekit.kernels.cslt_tune import TunedConfig, TuneResult
from prunekit.prune import prune_checkpoint

from ..test_cli import assert_clean_failure, invoke


@pytest.fixture
def pruned_24(tmp_path):
    """A 2:4-pruned fp16 state dict with one layer cuSPARSELt takes (fc: 256 x 512, with bias) and one it does not
    (odd: 48 x 64, M % 32 != 0)."""
    g = torch.Generator().manual_seed(0)
    state = {
        "fc.weight": torch.randn(256, 512, generator=g).half(),
        "fc.bias": torch.randn(256, generator=g).half(),
        "odd.weight": torch.randn(48, 64, generator=g).half(),
    }
    save_file(state, str(tmp_path / "dense.safetensors"))
    prune_checkpoint(tmp_path / "dense.safetensors", tmp_path / "p.safetensors", "2:4")
    return tmp_path / "p.safetensors"


def _fake_result(shapes, tokens, progress=None):
    configs = [
        TunedConfig(s.m, s.k, s.dtype, x_row, s.bias, b, 7 if x_row else -1)
        for s in shapes
        for b in tokens
        for x_row in (False, True)
    ]
    configs[-1] = dataclasses.replace(configs[-1], config_id=-1, failed="ended by SIGILL")
    return TuneResult("Fake GPU", 800, torch.__version__, list(tokens), 0.5, configs)


def test_export_stores_the_search_and_load_stages_it(tmp_path, pruned_24, monkeypatch):
    monkeypatch.setattr(cslt_tune, "unavailable_reason", lambda: None)
    monkeypatch.setattr(cslt_tune, "search", _fake_result)
    monkeypatch.setattr(cslt_tune, "_staged", [])
    result = export_package(pruned_24, tmp_path / "pkg", tune_tokens=[128, 300])
    record = result.manifest.tuning["cslt"]
    assert record["device"] == "Fake GPU" and record["tokens"] == [128, 512]
    assert {(c["m"], c["k"], c["dtype"], c["bias"]) for c in record["configs"]} == {(256, 512, "float16", True)}
    assert "4 products of 1 2:4 layer shape searched on Fake GPU in 0.5 s at export" in result.tuning_note
    assert "(N buckets 128, 512; 1 with an id other than the default selection, 1 failed" in result.tuning_note
    assert result.tuning_note in (tmp_path / "pkg" / "REPORT.md").read_text()
    assert build_report(tmp_path / "pkg").tuning_note == result.tuning_note
    on_disk = json.loads((tmp_path / "pkg" / "manifest.json").read_text())
    assert on_disk["tuning"] == result.manifest.tuning
    load(tmp_path / "pkg")
    assert cslt_tune._staged == [TuneResult.from_dict(record)]  # no binding on this machine: kept for when it loads


def test_export_without_a_gpu_searches_nothing_unless_asked(tmp_path, pruned_24, monkeypatch):
    monkeypatch.setattr(cslt_tune, "unavailable_reason", lambda: "no CUDA GPU is visible")
    result = export_package(pruned_24, tmp_path / "pkg")
    assert result.manifest.tuning == {}
    assert result.tuning_note == "cuSPARSELt configurations: not searched (no CUDA GPU is visible)"
    with pytest.raises(KernelUnavailable, match="--tune cannot search cuSPARSELt configurations here"):
        export_package(pruned_24, tmp_path / "pkg2", tune=True)
    assert not (tmp_path / "pkg2").exists()
    assert export_package(pruned_24, tmp_path / "pkg3", tune=False).tuning_note.endswith("not searched (--no-tune)")
    with pytest.raises(PrunekitError, match="N >= 128"):
        export_package(pruned_24, tmp_path / "pkg4", tune_tokens=[16])
    assert not (tmp_path / "pkg4").exists()


def test_export_off_by_the_environment_and_without_24_layers(tmp_path, pruned_24, mlp_safetensors, monkeypatch):
    monkeypatch.setattr(cslt_tune, "unavailable_reason", lambda: None)
    monkeypatch.setattr(cslt_tune, "search", lambda *a, **k: pytest.fail("searched"))
    monkeypatch.setenv("PRUNEKIT_CSLT_TUNE", "0")
    assert export_package(pruned_24, tmp_path / "pkg").tuning_note.endswith("not searched ($PRUNEKIT_CSLT_TUNE=0)")
    monkeypatch.delenv("PRUNEKIT_CSLT_TUNE")
    prune_checkpoint(mlp_safetensors, tmp_path / "u.safetensors", "unstructured", 0.5)
    unstructured = export_package(tmp_path / "u.safetensors", tmp_path / "pkg2")
    assert unstructured.tuning_note == "" and "cuSPARSELt" not in (tmp_path / "pkg2" / "REPORT.md").read_text()


def _rewrite_manifest(package, edit):
    path = package / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_manifest_tuning_is_validated_and_optional(tmp_path, pruned_24, monkeypatch):
    monkeypatch.setattr(cslt_tune, "unavailable_reason", lambda: None)
    monkeypatch.setattr(cslt_tune, "search", _fake_result)
    monkeypatch.setattr(cslt_tune, "_staged", [])
    package = tmp_path / "pkg"
    export_package(pruned_24, package, tune_tokens=[128])
    _rewrite_manifest(package, lambda d: d.pop("tuning"))  # a package written before the record existed
    assert load(package).manifest.tuning == {}
    cases = [
        (lambda d: d.update(tuning={"other": {}}), "tuning has unknown key 'other'"),
        (lambda d: d.update(tuning=[]), "tuning has the wrong type"),
        (lambda d: d["tuning"]["cslt"].pop("device"), "tuning.cslt is missing 'device'"),
        (lambda d: d["tuning"]["cslt"]["configs"][0].update(x_row=1), r"configs\[0\].x_row has the wrong type"),
        (lambda d: d["tuning"]["cslt"]["configs"][1].update(extra=0), r"configs\[1\] has unknown key 'extra'"),
        (lambda d: d["tuning"]["cslt"]["configs"][0].update(dtype="float32"), "must be float16 or bfloat16"),
        (lambda d: d["tuning"]["cslt"]["configs"][0].update(n_bucket=200), "n_bucket must be a power of two"),
    ]
    for edit, match in cases:
        export_package(pruned_24, package, tune_tokens=[128], overwrite=True)
        _rewrite_manifest(package, edit)
        with pytest.raises(IntegrityError, match=match):
            load(package)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_cli_export_tune_without_a_gpu_fails_cleanly(tmp_path, pruned_24):
    assert_clean_failure(invoke("export", pruned_24, "-o", tmp_path / "pkg", "--tune"), "--tune cannot", tmp_path)
    assert_clean_failure(
        invoke("export", pruned_24, "-o", tmp_path / "pkg", "--tune-tokens", "128,x"), "expected integers", tmp_path
    )
    assert_clean_failure(
        invoke("export", pruned_24, "-o", tmp_path / "pkg", "--tune-tokens", "64"), "N >= 128", tmp_path
    )
    ok = invoke("export", pruned_24, "-o", tmp_path / "pkg")
    assert ok.exit_code == 0 and "cuSPARSELt configurations: not searched" in ok.output


RUN_STORED = textwrap.dedent(
    """
    import json, sys, torch
    from prunekit.deploy.runtime import load
    from prunekit.kernels import structured
    pkg = load(sys.argv[1], device="cuda")
    layer = pkg.model.layer("fc").half()
    x = torch.randn(int(sys.argv[2]), layer.in_features, device="cuda").half()
    with torch.inference_mode():
        y = layer(x)
    torch.cuda.synchronize()
    weight = getattr(layer.w_values, structured._NATIVE_ATTR)
    ref = torch.nn.functional.linear(x.double(), structured._decode_nm_dense(
        layer.w_values, layer.w_metadata, 2, 4, int(layer.params["bits"]), layer.in_features).double(), layer.bias.double())
    err = float((y.double() - ref).norm() / ref.norm())
    print(json.dumps({"last": [int(v) for v in torch.ops.prunekit_cslt.last_config(weight.id)], "err": err}))
    """
)


@pytest.mark.cuda
def test_package_runs_its_24_layer_on_the_id_searched_at_export(tmp_path, pruned_24):
    """Export searches fc's products on this GPU (a child process); a fresh process that loads the package runs fc at
    N = 256 on the stored id (``last_config`` source 3: no search there), with the float64 result."""
    if not structured.cusparselt_available():
        pytest.skip("needs cuSPARSELt")
    result = export_package(pruned_24, tmp_path / "pkg", tune=True, tune_tokens=[256])
    record = result.manifest.tuning["cslt"]
    assert record["device"] == torch.cuda.get_device_name() and len(record["configs"]) == 2
    stored = {c["x_row"]: c["config_id"] for c in record["configs"] if c["failed"] is None}
    assert set(stored) == {False, True}
    out = subprocess.run(
        [sys.executable, "-c", RUN_STORED, str(tmp_path / "pkg"), "256"], capture_output=True, text=True, check=True
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["last"] == [stored[False], 3] and got["err"] < 2e-3
