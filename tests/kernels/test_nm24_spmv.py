"""The 2:4 SpMV kernel (``csrc/structured/nm24/nm24_spmv.cu``, ``prunekit_nm24::spmv24``): N = 1 on the stored nm
format, against float64 with the output's memory poisoned first; its routes through ``nm24.decode_mm`` (so
``prunekit::nm_mm``) and the runtime's ``SparseLinear``; its refusals; chained layers with programmatic dependent launch
on and off, eagerly and in a CUDA graph. The CPU tests check the runtime's route with the launch replaced by the
reference op."""

from __future__ import annotations

import pytest
import torch

from prunekit import formats
from prunekit.kernels import nm24, reference
from prunekit.kernels.testing import TOLERANCE, relative_error, rerun_chain, spmm_reference64

from .test_nm24_decode import encode24, weight24

DTYPES = [torch.float16, torch.bfloat16]


def _wave() -> int:
    """Warps of one wave as nm24_spmv.cu counts them (4 blocks of 8 warps per SM)."""
    return torch.cuda.get_device_properties(0).multi_processor_count * 4 * 8


def _poison(numel: int, dtype: torch.dtype) -> None:
    """Fill a block the caching allocator hands out next for ``numel`` elements with NaN."""
    torch.full((numel,), float("nan"), dtype=dtype, device="cuda")
    torch.cuda.synchronize()


def _case(m, k, dtype, seed, *, rows, x_stride=1, relu=True, bias=True):
    dense = weight24(m, k, torch.float32, seed=seed).to(dtype).cuda()
    values, metadata, bits = (t.cuda() if isinstance(t, torch.Tensor) else t for t in encode24(dense.cpu()))
    g = torch.Generator(device="cuda").manual_seed(seed)
    xfull = torch.randn(k, x_stride, generator=g, device="cuda").to(dtype)
    x = xfull[:, :1]  # (K, 1), stride x_stride along K
    b = torch.randn(m, generator=g, device="cuda").to(dtype) if bias else None
    _poison(m, dtype)
    y = nm24.spmv(values, metadata, x.t() if rows else x, b, relu, rows=rows)
    torch.cuda.synchronize()
    assert y.shape == ((1, m) if rows else (m, 1))
    assert not torch.isnan(y).any()
    ref = spmm_reference64(dense, x, b, "relu" if relu else "none")
    assert relative_error(y.t() if rows else y, ref) <= TOLERANCE[dtype]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [False, True])
@pytest.mark.parametrize(("m", "k"), [(1, 16), (3, 48), (77, 208), (768, 3072), (3072, 768), (100, 11008)])
def test_spmv24_matches_float64(dtype, rows, m, k):
    _case(m, k, dtype, seed=m + k, rows=rows)


@pytest.mark.cuda
@pytest.mark.parametrize("factor", [1.5, 3, 6])  # 2, 4 and 8 rows per warp
def test_spmv24_several_rows_per_warp(factor):
    _case(int(_wave() * factor) + 3, 96, torch.float16, seed=int(10 * factor), rows=True)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_spmv24_strided_x_no_bias(dtype):
    _case(130, 512, dtype, seed=4, rows=False, x_stride=3, relu=False, bias=False)


@pytest.mark.cuda
def test_spmv24_refuses_what_it_cannot_take():
    values, metadata, bits = encode24(weight24(8, 40, torch.float16))
    values, metadata = values.cuda(), metadata.cuda()
    x = torch.randn(40, 1, device="cuda", dtype=torch.float16)
    assert not nm24.spmv_takes(values, metadata, x, bits)  # K = 40: not a multiple of 16
    with pytest.raises(RuntimeError, match="multiple of 16"):
        nm24.spmv(values, metadata, x)
    values, metadata, bits = encode24(weight24(8, 64, torch.float16))
    values, metadata = values.cuda(), metadata.cuda()
    with pytest.raises(RuntimeError, match="share one dtype"):
        nm24.spmv(values, metadata, torch.randn(64, 1, device="cuda"))
    with pytest.raises(RuntimeError, match=r"x must be \(K, 1\)"):
        nm24.spmv(values, metadata, torch.randn(64, 2, device="cuda", dtype=torch.float16))


@pytest.mark.cuda
def test_decode_mm_takes_spmv_at_one_token(monkeypatch):
    dense = weight24(256, 512, torch.float16, seed=6)
    values, metadata, bits = (t.cuda() if isinstance(t, torch.Tensor) else t for t in encode24(dense))
    x = torch.randn(512, 1, device="cuda", dtype=torch.float16)
    bias = torch.randn(256, device="cuda", dtype=torch.float16)
    calls = []
    real = nm24.spmv
    monkeypatch.setattr(nm24, "spmv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    y = nm24.decode_mm(values, metadata, x, bits, bias, "relu")
    assert calls and getattr(values, nm24._PLAN_ATTR, None) is None  # no tensor-core plan built
    assert relative_error(y, spmm_reference64(dense.cuda(), x, bias, "relu")) <= TOLERANCE[torch.float16]
    monkeypatch.setenv(nm24.SPMV_ENV, "0")
    y0 = nm24.decode_mm(values, metadata, x, bits, bias, "relu")
    assert len(calls) == 1 and getattr(values, nm24._PLAN_ATTR, None) is not None
    assert relative_error(y0, spmm_reference64(dense.cuda(), x, bias, "relu")) <= TOLERANCE[torch.float16]


@pytest.mark.cuda
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("pdl", ["1", "0"])
def test_chained_spmv24_layers_read_the_previous_output(graph, pdl, monkeypatch):
    monkeypatch.setenv("PRUNEKIT_NM24_PDL", pdl)
    width, dtype = 2048, torch.float16
    layers = []
    for i in range(4):
        dense = (weight24(width, width, torch.float32, seed=20 + i) * (2 / width**0.5)).to(dtype)
        values, metadata, _ = encode24(dense)
        layers.append((dense.cuda(), values.cuda(), metadata.cuda(), (0.1 * torch.randn(width)).to(dtype).cuda()))
    x0 = torch.randn(1, width, device="cuda", dtype=dtype)
    outs = [torch.empty(1, width, device="cuda", dtype=dtype) for _ in layers]

    def chain():
        x = x0
        for (_, values, metadata, b), out in zip(layers, outs, strict=True):
            out.fill_(float("nan"))
            out.copy_(nm24.spmv(values, metadata, x, b, True, rows=True))
            x = out

    rerun_chain(chain, x0, graph)
    for (dense, _, _, b), x, out in zip(layers, [x0, *outs[:-1]], outs, strict=True):
        assert not torch.isnan(out).any()
        assert relative_error(out.t(), spmm_reference64(dense, x.t(), b, "relu")) <= TOLERANCE[dtype]


@pytest.mark.cuda
def test_sparse_linear_takes_spmv_at_one_token(monkeypatch):
    from prunekit.deploy.runtime.sparse_linear import SparseLinear

    dense = weight24(384, 768, torch.float16, seed=7)
    bias = torch.randn(384).half()
    layer = SparseLinear(formats.encode("nm", dense, {"n": 2, "m": 4}), bias).cuda()
    calls = []
    real = nm24.spmv_entry()
    monkeypatch.setattr(nm24, "spmv_entry", lambda: lambda *a: calls.append(1) or real(*a))
    x = torch.randn(1, 768, device="cuda", dtype=torch.float16)
    with torch.inference_mode():
        y = layer(x)
    assert calls == [1] and y.shape == (1, 384)
    ref = x.double() @ dense.double().cuda().t() + bias.double().cuda()
    assert relative_error(y, ref) < TOLERANCE[torch.float16]


def test_sparse_linear_spmv_route_on_cpu(monkeypatch):
    """The runtime's one-token 2:4 call with the launch replaced by the reference op: taken once decided, with the
    activations (1, K) as they are, and decided again when the weight's storage changes."""
    from prunekit.deploy.runtime import sparse_linear
    from prunekit.deploy.runtime.sparse_linear import SparseLinear

    dense = weight24(48, 64, torch.float16, seed=2)
    bias = torch.randn(48).half()
    layer = SparseLinear(formats.encode("nm", dense, {"n": 2, "m": 4}), bias)
    decided, launches = [], []
    monkeypatch.setattr(sparse_linear, "_eager_cuda", lambda xt: True)
    monkeypatch.setattr(nm24, "decode_takes", lambda values, x, n, m_group: True)
    monkeypatch.setattr(nm24, "spmv_takes", lambda *a: decided.append(1) or True)
    monkeypatch.setattr(nm24, "available", lambda: True)

    def launch(values, metadata, x, b, relu, rows):  # the C++ entry's arguments, all given
        assert rows and not relu and x.shape == (1, 64)
        launches.append(1)
        return reference.nm_mm(values, metadata, x.t(), 2, 4, 2, b, "none").t()

    monkeypatch.setattr(nm24, "spmv_entry", lambda: launch)
    for _ in range(3):
        x = torch.randn(1, 64).half()
        y = layer(x)
        ref = x.double() @ dense.double().t() + bias.double()
        assert y.shape == (1, 48) and relative_error(y, ref) < TOLERANCE[torch.float16]
    assert len(launches) == 3 and len(decided) == 1
    layer.w_values = layer.w_values.clone()  # new storage: decided again
    layer(torch.randn(1, 64).half())
    assert len(decided) == 2
