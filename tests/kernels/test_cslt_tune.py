"""The cuSPARSELt configuration search at export (``kernels/cslt_tune.py``): the products it searches, its child-process
protocol with a child that dies or hangs (a fake child on CPU), the runtime's hand-over of stored ids, and on the GPU
the binding's ``store_config`` and a real search in a child."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch

from prunekit.deploy.runtime.manifest import TensorEntry
from prunekit.errors import KernelUnavailable, PrunekitError
from prunekit.kernels import cslt_tune, structured
from prunekit.kernels.cslt_tune import LayerShape, TunedConfig, TuneResult


def _entry(name: str, fmt: str, shape: tuple[int, int], dtype: str = "float16", params: dict | None = None):
    params = {"n": 2, "m": 4, "bits": 2} if params is None and fmt == "nm" else (params or {})
    return TensorEntry(name, fmt, list(shape), list(shape), dtype, params, {}, None, None, 0, 0)


def test_layer_shapes_takes_aligned_24_layers_with_their_bias_and_runtime_dtypes():
    entries = [
        _entry("fc1.weight", "nm", (256, 512)),
        _entry("fc1.bias", "dense", (256, 1)),
        _entry("fc2.weight", "nm", (512, 256), "float32"),  # fp32: searched in both kernel dtypes
        _entry("fc3.weight", "nm", (48, 512)),  # M % 32 != 0: cuSPARSELt does not take it
        _entry("fc4.weight", "nm", (256, 96)),  # K % 64 != 0
        _entry("fc5.weight", "nm", (256, 512), params={"n": 1, "m": 4, "bits": 2}),  # 1:4: not cuSPARSELt
        _entry("fc6.weight", "csr", (256, 512)),
        _entry("fc7.weight", "nm", (256, 512)),  # the same product as fc1 but without bias
        _entry("dup.weight", "nm", (256, 512)),
        _entry("dup.bias", "dense", (256, 1)),  # the same product as fc1: listed once
    ]
    assert cslt_tune.layer_shapes(entries) == [
        LayerShape(256, 512, "float16", False),
        LayerShape(256, 512, "float16", True),
        LayerShape(512, 256, "bfloat16", False),
        LayerShape(512, 256, "float16", False),
    ]


def test_buckets_round_up_to_powers_of_two_and_refuse_decode_sizes():
    assert cslt_tune.buckets([128, 129, 200, 256, 3000]) == [128, 256, 4096]
    assert cslt_tune.n_bucket(1) == 1 and cslt_tune.n_bucket(8192) == 8192 and cslt_tune.n_bucket(8193) == 16384
    with pytest.raises(PrunekitError, match="N >= 128"):
        cslt_tune.buckets([64, 256])


FAKE_CHILD = textwrap.dedent(
    """
    import json, os, signal, sys, time
    items = json.loads(sys.stdin.read())["items"]
    mode = os.environ["FAKE_CHILD_MODE"]
    if mode == "broken":
        sys.stderr.write("Traceback (most recent call last):\\n" + "x" * 200000 + "\\nImportError: no module named foo\\n")
        sys.exit(1)
    if mode == "error":
        print(json.dumps({"error": "no GPU here"}), flush=True)
        sys.exit(3)
    print("a library's banner on stdout", flush=True)
    print(json.dumps({"device": "Fake GPU", "cusparselt_version": 800, "torch": "x"}), flush=True)
    for item in items:
        if item["n_bucket"] == 256 and item["x_row"]:
            if mode == "crash":
                os.kill(os.getpid(), signal.SIGILL)
            if mode == "hang":
                time.sleep(60)
        source = 0 if item["m"] == 64 else 1  # the binding did not search this product (e.g. TUNE off)
        print(json.dumps({"item": item["item"], "config_id": item["m"] % 7, "source": source}), flush=True)
    """
)


@pytest.fixture
def fake_child(tmp_path, monkeypatch):
    script = tmp_path / "fake_child.py"
    script.write_text(FAKE_CHILD)

    def run(mode: str, shapes, tokens):
        monkeypatch.setenv("FAKE_CHILD_MODE", mode)
        seen = []
        result = cslt_tune.search(
            shapes, tokens, progress=lambda d, t, _: seen.append((d, t)), command=[sys.executable, str(script)]
        )
        return result, seen

    return run


def test_search_collects_every_product_the_child_searched(fake_child):
    shapes = [LayerShape(96, 128, "float16", True), LayerShape(64, 128, "bfloat16", False)]
    result, seen = fake_child("ok", shapes, [128, 256])
    assert (result.device, result.cusparselt_version, result.tokens) == ("Fake GPU", 800, [128, 256])
    # 2 shapes x 2 buckets x 2 X layouts = 8 products; the 64-row shape's were not searched (source 0): left out
    assert result.configs == [
        TunedConfig(96, 128, "float16", x_row, True, bucket, 96 % 7) for bucket in (128, 256) for x_row in (False, True)
    ]
    assert seen[-1] == (8, 8) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert TuneResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result


def test_search_pins_a_product_whose_child_died_to_the_default_and_goes_on(fake_child):
    shapes = [LayerShape(96, 128, "float16", False), LayerShape(160, 128, "float16", False)]
    result, seen = fake_child("crash", shapes, [128, 256, 512])
    failed = [c for c in result.configs if c.failed is not None]
    # one crash per shape, at bucket 256 with row-major X; a new child took the rest each time
    assert [(c.m, c.n_bucket, c.x_row, c.config_id) for c in failed] == [(96, 256, True, -1), (160, 256, True, -1)]
    assert all(c.failed == "ended by SIGILL" for c in failed)
    assert len(result.configs) == 12 and seen[-1] == (12, 12)
    assert all(c.config_id == c.m % 7 for c in result.configs if c.failed is None)


def test_search_stops_a_child_past_its_time_limit(fake_child, monkeypatch):
    monkeypatch.setattr(cslt_tune, "TIMEOUT_BASE_S", 2.0)
    monkeypatch.setattr(cslt_tune, "TIMEOUT_PER_ITEM_S", 0.0)
    result, _ = fake_child("hang", [LayerShape(96, 128, "float16", False)], [256])
    assert [(c.x_row, c.failed) for c in result.configs] == [(False, None), (True, "passed its time limit of 2 s")]


def test_search_raises_when_the_child_cannot_search(fake_child):
    with pytest.raises(KernelUnavailable, match="no GPU here"):
        fake_child("error", [LayerShape(96, 128, "float16", False)], [128])
    # a child that dies before its first line (here after 200 kB of stderr) is no product's fault: no retry
    with pytest.raises(KernelUnavailable, match=r"exited with status 1 \(ImportError: no module named foo\)"):
        fake_child("broken", [LayerShape(96, 128, "float16", False)], [128])


def _record(device: str = "Fake GPU", version: int | None = 800) -> dict:
    configs = [
        TunedConfig(96, 128, "bfloat16", True, False, 256, 5),
        TunedConfig(96, 128, "float16", False, True, 128, -1, "x"),
    ]
    return TuneResult(device, version, "2.x", [128, 256], 1.5, configs).to_dict()


def test_staged_ids_reach_the_binding_only_on_the_same_gpu_and_cusparselt(monkeypatch):
    calls = []
    monkeypatch.setattr(cslt_tune, "_staged", [])
    monkeypatch.setattr(cslt_tune, "_binding_loaded", lambda: True)
    monkeypatch.setattr(cslt_tune, "_store_op", lambda: lambda *a: calls.append(a) or True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(torch.backends.cusparselt, "version", lambda: 800)
    cslt_tune.stage(_record())  # the binding is loaded: applied at once
    assert calls == [(96, 128, 1, True, False, 256, 5), (96, 128, 0, False, True, 128, -1)]

    def refuse(*args):
        calls.append(args)
        raise RuntimeError("cslt_store_config: bad key")

    monkeypatch.setattr(cslt_tune, "_store_op", lambda: refuse)
    calls.clear()
    cslt_tune.stage(_record())  # a key the binding refuses is skipped with a log line, not raised into the layer call
    assert len(calls) == 2 and cslt_tune._staged == []
    monkeypatch.setattr(cslt_tune, "_store_op", lambda: lambda *a: calls.append(a) or True)
    calls.clear()
    cslt_tune.stage(_record(device="Other GPU"))
    cslt_tune.stage(_record(version=900))
    cslt_tune.stage(None)
    assert calls == [] and cslt_tune._staged == []


def test_staged_ids_wait_for_the_binding(monkeypatch):
    calls = []
    loaded = [False]
    monkeypatch.setattr(cslt_tune, "_staged", [])
    monkeypatch.setattr(cslt_tune, "_binding_loaded", lambda: loaded[0])
    monkeypatch.setattr(cslt_tune, "_store_op", lambda: lambda *a: calls.append(a) or True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(torch.backends.cusparselt, "version", lambda: 800)
    cslt_tune.stage(_record())
    assert calls == [] and len(cslt_tune._staged) == 1
    loaded[0] = True
    assert cslt_tune.apply_staged() == 2 and len(calls) == 2 and cslt_tune._staged == []


# --- GPU: the binding's store_config, and a real search in a child --------------------------------------------------


def _needs_binding():
    if not torch.cuda.is_available() or not structured.cusparselt_available():
        pytest.skip("needs a CUDA GPU with cuSPARSELt")
    assert structured.native_cslt_available()


@pytest.mark.cuda
@pytest.mark.parametrize("x_row", [False, True])
def test_binding_takes_a_stored_id_without_searching_and_stays_right(x_row, monkeypatch):
    """``store_config`` gives a key its id: the plan takes it (``last_config`` source 3) and no search runs; an id the
    product cannot plan falls back to the default selection; a key already held is not replaced; under
    ``$PRUNEKIT_CSLT_TUNE=0`` stored ids are not used. Every output, bias fused, matches float64 with Y poisoned."""
    from prunekit.kernels.testing import TOLERANCE, relative_error, spmm_reference64

    _needs_binding()
    monkeypatch.delenv("PRUNEKIT_CSLT_TUNE", raising=False)
    m, k = (608, 704) if x_row else (640, 704)  # shapes no other test uses: the binding's choices last the process
    dense = torch.randn(m, k // 4, 4)
    dense[..., 2:] = 0
    dense = dense.reshape(m, k).half().cuda()
    bias = torch.randn(m, device="cuda").half()
    store = torch.ops.prunekit_cslt.store_config
    assert store(m, k, 0, x_row, True, 256, 0)  # id 0: one cuSPARSELt always offers
    assert not store(m, k, 0, x_row, True, 256, 3)  # held: unchanged
    assert store(m, k, 0, x_row, True, 512, 1_000_000 - 1)  # no such id: the plan falls back
    wid = int(torch.ops.prunekit_cslt.prepare(dense))
    try:
        for n_tokens, expect in ((256, [0, 3]), (208, [0, 3]), (512, [-1, 0])):
            x = (
                torch.randn(k, n_tokens, device="cuda").half()
                if x_row
                else torch.randn(n_tokens, k, device="cuda").half().t()
            )
            y = torch.empty(m, n_tokens, device="cuda").half().fill_(float("nan"))
            torch.ops.prunekit_cslt.mm(wid, x, y, bias, False)
            torch.cuda.synchronize()
            assert [int(v) for v in torch.ops.prunekit_cslt.last_config(wid)] == expect, n_tokens
            assert relative_error(y, spmm_reference64(dense, x, bias, "none")) < TOLERANCE[torch.float16]
        monkeypatch.setenv("PRUNEKIT_CSLT_TUNE", "0")
        x = torch.randn(k, 240, device="cuda").half() if x_row else torch.randn(240, k, device="cuda").half().t()
        y = torch.empty(m, 240, device="cuda").half()
        torch.ops.prunekit_cslt.mm(wid, x, y, bias, False)
        assert [int(v) for v in torch.ops.prunekit_cslt.last_config(wid)] == [-1, 0]
    finally:
        torch.ops.prunekit_cslt.release(wid)


@pytest.mark.cuda
def test_binding_refuses_a_bad_stored_key():
    _needs_binding()
    with pytest.raises(RuntimeError, match="n_bucket must be a power of two"):
        torch.ops.prunekit_cslt.store_config(256, 512, 0, False, False, 200, 0)
    with pytest.raises(RuntimeError, match="dtype must be 0"):
        torch.ops.prunekit_cslt.store_config(256, 512, 2, False, False, 256, 0)


@pytest.mark.cuda
def test_search_in_a_child_on_this_gpu():
    _needs_binding()
    shapes = [LayerShape(320, 640, "float16", True), LayerShape(320, 640, "bfloat16", False)]
    result = cslt_tune.search(shapes, [128, 512])
    assert result.device == torch.cuda.get_device_name()
    assert result.cusparselt_version == torch.backends.cusparselt.version()
    assert len(result.configs) == 8  # 2 shapes x 2 buckets x 2 X layouts, all searched in the child
    assert all(c.failed is None and c.config_id >= -1 for c in result.configs)
    assert {(c.dtype, c.bias, c.n_bucket, c.x_row) for c in result.configs} == {
        (d, b, n, r) for d, b in (("float16", True), ("bfloat16", False)) for n in (128, 512) for r in (False, True)
    }
