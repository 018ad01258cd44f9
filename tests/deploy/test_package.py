from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from prunekit.deploy.convert import METADATA_KEY, convert_checkpoint
from prunekit.deploy.export import export_package
from prunekit.deploy.report import build_report, save_plot
from prunekit.deploy.runtime import SparseLinear, TensorEntry, load, run
from prunekit.errors import IntegrityError
from prunekit.formats import decode, encode
from prunekit.io import open_checkpoint
from prunekit.io.safetensors_io import read_header
from prunekit.prune import prune_checkpoint, prune_tensor
from prunekit.prune.patterns import NM, Block, Unstructured

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float64: 1e-12}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    "fmt,pattern,params",
    [
        ("csr", Unstructured(), {}),
        ("bsr", Block(8, 4), {"block_rows": 8, "block_cols": 4}),
        ("nm", NM(2, 4), {"n": 2, "m": 4}),
        ("nm", NM(1, 4), {"n": 1, "m": 4}),
        ("bitmask", Unstructured(), {}),
        ("dense", Unstructured(), {}),
    ],
)
def test_sparse_linear_matches_float64_dense_linear(dtype, fmt, pattern, params):
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        w = prune_tensor(
            torch.randn(40, 24, generator=g).to(dtype), pattern, pattern.check_sparsity(0.6 if fmt != "nm" else None)
        )
        w[3] = 0  # empty row
        bias = torch.randn(40, generator=g).to(dtype)
        x = torch.randn(2, 7, 24, generator=g).to(dtype)
        layer = SparseLinear(encode(fmt, w, params), bias)
        out = layer(x)
        ref = F.linear(x.double(), w.double(), bias.double())
        assert out.shape == (2, 7, 40) and out.dtype == dtype
        err = (out.double() - ref).norm() / ref.norm()
        assert err < TOLERANCE[dtype], err


def hf_outputs(model_dir, input_ids):
    import transformers

    model = transformers.AutoModel.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).last_hidden_state


@pytest.mark.parametrize(
    "pattern,sparsity,fmt",
    [
        ("unstructured", 0.5, "auto"),
        ("2:4", None, "auto"),
        ("block:8x8", 0.5, "auto"),
        ("unstructured", 0.7, "bitmask"),
        ("4:8", None, "csr"),
    ],
)
def test_package_output_equals_pruned_dense_model(tmp_path, tiny_bert_dir, pattern, sparsity, fmt):
    pruned, package = tmp_path / "pruned", tmp_path / "pkg"
    result = prune_checkpoint(tiny_bert_dir, pruned, pattern, sparsity)
    assert len(result.pruned) == 12  # q, k, v, attn-out, intermediate, output per layer
    export_package(pruned, package, fmt)
    input_ids = torch.randint(0, 120, (3, 11), generator=torch.Generator().manual_seed(1))
    loaded = load(package)
    n_sparse = sum(isinstance(m, SparseLinear) for m in loaded.model.modules())
    assert n_sparse == 12
    out = run(loaded, inputs={"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)})
    ref = hf_outputs(pruned, input_ids)
    assert out["last_hidden_state"].dtype == ref.dtype
    torch.testing.assert_close(out["last_hidden_state"], ref, rtol=1e-4, atol=1e-4)
    dense_out = hf_outputs(tiny_bert_dir, input_ids)
    assert not torch.allclose(dense_out, ref)  # pruning changed the model: the comparison is not vacuous


def test_manifest_bytes_equal_the_stored_tensor_sizes(tmp_path, tiny_bert_dir):
    prune_checkpoint(tiny_bert_dir, tmp_path / "pruned", "unstructured", 0.8)
    export_package(tmp_path / "pruned", tmp_path / "pkg")
    manifest = json.loads((tmp_path / "pkg" / "manifest.json").read_text())
    weights = tmp_path / "pkg" / "weights.safetensors"
    header = read_header(weights)
    sizes = {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if not k.startswith("__")}
    for entry in manifest["tensors"]:
        assert entry["nbytes"] == sum(sizes[key] for key in entry["components"].values())
    data_nbytes = weights.stat().st_size - 8 - header["__header_nbytes__"]
    assert sum(e["nbytes"] for e in manifest["tensors"]) == sum(sizes.values()) == data_nbytes
    report = build_report(tmp_path / "pkg")
    assert report.total_stored_nbytes == data_nbytes
    assert report.pruned_stored_nbytes < report.pruned_dense_nbytes
    for r in report.rows:  # exact to one element
        numel = r.shape[0] * r.shape[1]
        assert r.sparsity == round(0.8 * numel) / numel


def test_state_dict_package_runs_each_layer_like_the_pruned_weights(tmp_path, mlp_safetensors, mlp_pt):
    for src, name in ((mlp_safetensors, "a.safetensors"), (mlp_pt, "a.pt")):
        pruned = tmp_path / name
        result = prune_checkpoint(src, pruned, "unstructured", 0.75)
        assert {t.name for t in result.pruned} == {"fc1.weight", "fc2.weight", "conv.weight"}
        package = tmp_path / f"{name}.pkg"
        export_package(pruned, package)
        ckpt = open_checkpoint(pruned)
        x = torch.randn(5, 32)
        out = run(load(package), inputs={"fc1": x})
        ref = F.linear(x, ckpt.get("fc1.weight"), ckpt.get("fc1.bias"))
        torch.testing.assert_close(out["fc1"], ref)


def test_convert_writes_self_describing_kernel_ready_file(tmp_path, mlp_safetensors):
    prune_checkpoint(mlp_safetensors, tmp_path / "p.safetensors", "2:4")
    result = convert_checkpoint(tmp_path / "p.safetensors", tmp_path / "c.safetensors", "nm")
    pruned = open_checkpoint(tmp_path / "p.safetensors")
    with safe_open(str(tmp_path / "c.safetensors"), framework="pt") as f:
        entries = [TensorEntry(**e) for e in json.loads(f.metadata()[METADATA_KEY])]
        assert [e.name for e in entries] == [e.name for e in result.entries]
        for entry in entries:
            comps = {c: f.get_tensor(k) for c, k in entry.components.items()}
            from prunekit.formats import EncodedTensor

            dense = decode(EncodedTensor(entry.format, tuple(entry.shape), entry.dtype, entry.params, comps))
            assert torch.equal(dense.reshape(entry.orig_shape), pruned.get(entry.name))
            if entry.pattern is not None:
                assert entry.format == "nm"


def test_tampered_or_incomplete_packages_are_refused(tmp_path, mlp_safetensors):
    prune_checkpoint(mlp_safetensors, tmp_path / "p.safetensors", "unstructured", 0.5)
    package = tmp_path / "pkg"
    export_package(tmp_path / "p.safetensors", package)
    load(package)
    weights = package / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="sha256"):
        load(package)
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    (package / "runtime" / "deploy" / "runtime" / "loader.py").write_text("import os\n")
    with pytest.raises(IntegrityError, match="loader.py"):
        load(package)
    manifest = json.loads((package / "manifest.json").read_text())
    manifest["surprise"] = 1
    (package / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IntegrityError, match="surprise"):
        load(package)
    (package / "manifest.json").unlink()
    with pytest.raises(IntegrityError, match="manifest"):
        load(package)


BLOCKER = textwrap.dedent(
    """
    import sys, importlib.abc
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in {"prunekit", "pydantic", "typer"}:
                raise ImportError("blocked: " + name)
    sys.meta_path.insert(0, Block())
    """
)


def test_exported_runtime_needs_no_prunekit(tmp_path, tiny_bert_dir):
    prune_checkpoint(tiny_bert_dir, tmp_path / "pruned", "2:4")
    package = tmp_path / "pkg"
    export_package(tmp_path / "pruned", package)
    script = BLOCKER + textwrap.dedent(
        f"""
        import torch
        sys.path.insert(0, {str(package)!r})
        import runtime
        pkg = runtime.load({str(package)!r})
        ids = torch.arange(10).reshape(1, 10)
        out = runtime.run(pkg, inputs={{"input_ids": ids, "attention_mask": torch.ones_like(ids)}})
        torch.save(out["last_hidden_state"], {str(tmp_path / "out.pt")!r})
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path)
    ids = torch.arange(10).reshape(1, 10)
    ref = hf_outputs(tmp_path / "pruned", ids)
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), ref, rtol=1e-4, atol=1e-4)


def test_report_json_and_plot(tmp_path, tiny_bert_dir):
    prune_checkpoint(tiny_bert_dir, tmp_path / "pruned", "block:8x8", 0.5)
    report = build_report(tmp_path / "pruned")
    data = report.to_dict()
    assert len(data["layers"]) == 12
    for layer in data["layers"]:
        assert layer["format_nbytes"]["bsr"] is not None and layer["format_nbytes"]["nm"] is None
        assert layer["stored_format"] == "bsr"
    save_plot(report, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
