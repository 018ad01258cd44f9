"""Programmatic dependent launch of the nm24 decode kernel (2:4 and bitmap; ``csrc/structured/nm24/nm24_decode.cu``).

By default (``$PRUNEKIT_NM24_PDL=0`` turns it off), on sm_90 with the cluster reduction the kernel is launched so that it may start while the preceding kernel
in the stream still runs: it loads its first weight batches, then waits for that kernel before it reads X or writes
anything. These tests chain layers, each reading the output the previous launch wrote (poisoned with NaN before), with
no synchronisation between the launches, eagerly and in a CUDA graph, and compare every stage against float64 on the
input it was given, with PDL on, off and unset. A kernel that read X early would see NaN or an older value. The
bitmap and 2:4 layers run on the ring kernel (``$PRUNEKIT_NM24_LEAN=0``) and on the lean one, forced on
(``bitmaplean``, ``nm24lean``: ``$PRUNEKIT_NM24_LEAN=1``).
"""

from __future__ import annotations

import pytest
import torch

from prunekit.kernels import gpu, nm24
from prunekit.kernels.testing import TOLERANCE, encode_csr, random_sparse_weight, relative_error, spmm_reference64

from .test_nm24_decode import encode24, weight24

pytestmark = pytest.mark.cuda

WIDTH = 2048  # square layers: each output is the next layer's input


def _layers(kind: str, count: int, dtype: torch.dtype):
    """``count`` (weight, bias, call) triples; call(x (K, N), out (M, N)) writes act(W x + b) into out and returns it."""
    g = torch.Generator(device="cuda").manual_seed(7)
    layers = []
    for i in range(count):
        bias = (0.1 * torch.randn(WIDTH, generator=g, device="cuda")).to(dtype)
        if kind.startswith("bitmap"):
            dense = (random_sparse_weight(WIDTH, WIDTH, 0.85, dtype, "cuda", g) * WIDTH**-0.5 * 3).to(dtype)
            c = encode_csr(dense)

            def call(x, out, c=c, bias=bias):
                return gpu.spmm_csr(
                    c["values"], c["row_offsets"], c["column_indices"], c["row_indices"], x, WIDTH, bias, "relu",
                    variant="bitmap", out=out,
                )  # fmt: skip
        else:
            dense = (weight24(WIDTH, WIDTH, torch.float32, seed=i) * WIDTH**-0.5 * 2).to(dtype).cuda()
            values, metadata, bits = encode24(dense)

            def call(x, out, values=values, metadata=metadata, bits=bits, bias=bias):
                out.copy_(nm24.decode_mm(values, metadata, x, bits, bias, "relu"))
                return out

        layers.append((dense, bias, call))
    return layers


def _chain(layers, x0: torch.Tensor, outs: list[torch.Tensor]) -> None:
    x = x0
    for (_, _, call), out in zip(layers, outs, strict=True):
        x = call(x, out)


def _set_kind(kind: str, monkeypatch) -> None:
    """The kind's settings: "...lean" runs the lean decode kernels ($PRUNEKIT_NM24_LEAN=1), the others the ring kernel
    (0); for "nm24lean" (mma.sp) at
    N = 1 too (the SpMV kernel, which takes N = 1 by default, switched off)."""
    monkeypatch.setenv(nm24.LEAN_ENV, "1" if kind.endswith("lean") else "0")
    if kind == "nm24lean":
        monkeypatch.setenv(nm24.MMA_ENV, "sp")
        monkeypatch.setenv(nm24.SPMV_ENV, "0")


@pytest.mark.parametrize("kind", ["bitmap", "nm24", "bitmaplean", "nm24lean"])
@pytest.mark.parametrize("pdl", ["1", "0", None])
@pytest.mark.parametrize("n", [1, 16])
def test_chained_layers_read_the_previous_output(kind, pdl, n, monkeypatch):
    _set_kind(kind, monkeypatch)
    if pdl is None:
        monkeypatch.delenv("PRUNEKIT_NM24_PDL", raising=False)
    else:
        monkeypatch.setenv("PRUNEKIT_NM24_PDL", pdl)  # read at each launch
    dtype = torch.float16
    layers = _layers(kind, 4, dtype)
    x0 = torch.randn(WIDTH, n, device="cuda").to(dtype)
    outs = [torch.empty(WIDTH, n, device="cuda", dtype=dtype) for _ in layers]
    for _ in range(3):
        for out in outs:
            out.fill_(float("nan"))
        _chain(layers, x0, outs)  # no synchronisation between the launches
        torch.cuda.synchronize()
        inputs = [x0, *outs[:-1]]
        for i, ((dense, bias, _), x, out) in enumerate(zip(layers, inputs, outs, strict=True)):
            assert not torch.isnan(out).any(), i
            assert relative_error(out, spmm_reference64(dense, x, bias, "relu")) <= TOLERANCE[dtype], i


@pytest.mark.parametrize("kind", ["bitmap", "nm24", "bitmaplean", "nm24lean"])
@pytest.mark.parametrize("pdl", ["1", "0"])
def test_chained_layers_in_a_cuda_graph(kind, pdl, monkeypatch):
    _set_kind(kind, monkeypatch)
    monkeypatch.setenv("PRUNEKIT_NM24_PDL", pdl)
    dtype = torch.float16
    layers = _layers(kind, 3, dtype)
    x0 = torch.randn(WIDTH, 16, device="cuda").to(dtype)
    outs = [torch.empty(WIDTH, 16, device="cuda", dtype=dtype) for _ in layers]
    _chain(layers, x0, outs)  # plans and workspaces exist before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for out in outs:
            out.fill_(float("nan"))
        _chain(layers, x0, outs)
    for seed in range(3):
        x0.copy_(torch.randn(WIDTH, 16, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        inputs = [x0, *outs[:-1]]
        for i, ((dense, bias, _), x, out) in enumerate(zip(layers, inputs, outs, strict=True)):
            assert relative_error(out, spmm_reference64(dense, x, bias, "relu")) <= TOLERANCE[dtype], (seed, i)
