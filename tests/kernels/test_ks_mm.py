"""``prunekit::ks_mm``: the reference against a float64 dense product, opcheck, fake strides, chains, and (with a
GPU) the CUDA kernels against float64 in both layouts and every dtype, on poisoned outputs."""

from __future__ import annotations

import pytest
import torch

from prunekit.formats.ks import blocks_to_dense
from prunekit.kernels import ks, ks_reference, ops
from prunekit.kernels.layout import new_spmm_output

TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
QUADS = [(1, 1, 1, 1), (2, 3, 4, 5), (3, 5, 2, 1), (1, 7, 9, 2), (4, 2, 2, 4), (1, 16, 16, 1), (2, 1, 6, 3)]


def case(quad, n, dtype, seed, transposed):
    a, b, c, d = quad
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randn(a, d, b, c, generator=g).to(dtype)
    x2d = torch.randn(n, a * c * d, generator=g).to(dtype)
    x = x2d.t() if transposed else x2d.t().contiguous()
    bias = torch.randn(a * b * d, generator=g).to(dtype)
    return blocks, x, bias


def reference64(blocks, x, bias=None, relu=False):
    y = blocks_to_dense(blocks.double()) @ x.double()
    if bias is not None:
        y = y + bias.double()[:, None]
    return torch.relu(y) if relu else y


def rel_err(out, ref):
    assert not torch.isnan(out).any()
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True], ids=["batch_last", "batch_first"])
def test_reference_matches_float64_dense_product(dtype, transposed):
    for seed, quad in enumerate(QUADS):
        blocks, x, bias = case(quad, 11, dtype, seed, transposed)
        for b_arg, relu in ((None, False), (bias, True)):
            out = ks_reference.ks_mm(blocks, x, b_arg, "relu" if relu else "none")
            assert out.dtype == dtype and out.shape == (quad[0] * quad[1] * quad[3], 11)
            assert rel_err(out, reference64(blocks, x, b_arg, relu)) < TOL[dtype]
            assert out.stride() == new_spmm_output(x, out.shape[0]).stride()  # layout.py: column-major X -> Y


def test_reference_chunks_large_n(monkeypatch):
    monkeypatch.setattr(ks_reference, "CHUNK_ELEMENTS", 64)
    for transposed in (False, True):
        blocks, x, bias = case((2, 3, 4, 2), 37, torch.float32, 0, transposed)
        assert rel_err(ks_reference.ks_mm(blocks, x, bias), reference64(blocks, x, bias)) < 1e-6


def test_reference_rejects_bad_shapes_and_activation():
    blocks, x, _ = case((2, 3, 4, 5), 4, torch.float32, 0, False)
    with pytest.raises(ValueError, match="a\\*c\\*d=40"):
        ks_reference.ks_mm(blocks, x[:-1])
    with pytest.raises(ValueError, match="blocks must be"):
        ks_reference.ks_mm(blocks[0], x)
    with pytest.raises(ValueError, match="unknown activation"):
        ks_reference.ks_mm(blocks, x, None, "gelu")


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_opcheck_ks_mm(transposed, with_bias):
    blocks, x, bias = case((2, 3, 4, 5), 6, torch.float32, 0, transposed)
    torch.library.opcheck(ops.ks.ks_mm, (blocks, x, bias if with_bias else None, "relu"))


@pytest.mark.parametrize("transposed", [False, True])
def test_ks_mm_fake_matches_real_strides(transposed):
    from torch._subclasses.fake_tensor import FakeTensorMode

    blocks, x, _ = case((2, 3, 4, 5), 7, torch.float32, 0, transposed)
    real = ops.ks.ks_mm(blocks, x)
    with FakeTensorMode() as mode:
        fake = ops.ks.ks_mm(mode.from_tensor(blocks), mode.from_tensor(x))
    assert fake.shape == real.shape and fake.stride() == real.stride() and fake.dtype == real.dtype


def test_chain_mm_is_the_product_of_its_factors_applied_last_first():
    g = torch.Generator().manual_seed(3)
    factors = [
        torch.randn(1, 2, 4, 4, generator=g),
        torch.randn(2, 2, 2, 2, generator=g),
        torch.randn(4, 1, 2, 4, generator=g),
    ]
    dense = (
        blocks_to_dense(factors[0]).double()
        @ blocks_to_dense(factors[1]).double()
        @ blocks_to_dense(factors[2]).double()
    )
    x2d = torch.randn(5, dense.shape[1], generator=g)
    bias = torch.randn(dense.shape[0], generator=g)
    for x in (x2d.t(), x2d.t().contiguous()):
        out = ks.ks_chain_mm(factors, x, bias, "relu")
        ref = torch.relu(dense @ x.double() + bias.double()[:, None])
        assert rel_err(out, ref) < 1e-6
        assert rel_err(ks_reference.ks_chain_mm(factors, x, bias, "relu"), ref) < 1e-6


def test_pick_tile_prefers_128_rows_only_for_multiples_of_128():
    assert ks.pick_tile(256, 256, torch.float16) == 128
    assert ks.pick_tile(192, 192, torch.bfloat16) == 64
    assert ks.pick_tile(48, 48, torch.float16) == 64
    assert ks.pick_tile(48, 48, torch.float32) == 128


CUDA_QUADS = [
    (1, 1, 1, 1),
    (2, 3, 5, 7),
    (1, 48, 48, 4),
    (2, 64, 64, 3),
    (3, 130, 70, 2),
    (1, 192, 192, 1),
    (4, 128, 256, 2),
    (8, 16, 16, 16),
    (1, 449, 903, 1),
]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True], ids=["batch_last", "batch_first"])
def test_cuda_ks_mm_matches_float64_on_poisoned_outputs(dtype, transposed):
    for seed, quad in enumerate(CUDA_QUADS):
        for n in (1, 37, 256):
            blocks, x, bias = case(quad, n, dtype, seed, transposed)
            blocks, x, bias = blocks.cuda(), x.cuda(), bias.cuda()
            ref = reference64(blocks.cpu(), x.cpu(), bias.cpu(), True)
            out = new_spmm_output(x, ref.shape[0]).fill_(float("nan"))
            variants = (
                [(128, True)] if dtype == torch.float32 else [(t, p) for t in ks.TILE_ROWS for p in (False, True)]
            )
            for tile, pipelined in variants:
                out.fill_(float("nan"))
                ks.ks_mm_cuda(blocks, x, bias, "relu", out=out, tile_rows=tile, pipelined=pipelined)
                torch.cuda.synchronize()
                tol = 1e-5 if dtype == torch.float32 else TOL[dtype]
                assert rel_err(out.cpu(), ref) < tol, (quad, n, tile, pipelined)
            y = ops.ks.ks_mm(blocks, x, bias, "relu")
            assert y.stride() == new_spmm_output(x, ref.shape[0]).stride()
            assert rel_err(y.cpu(), ref) < (1e-5 if dtype == torch.float32 else TOL[dtype])


@pytest.mark.cuda
def test_cuda_ks_mm_float64_runs_the_reference_on_the_gpu():
    blocks, x, bias = case((2, 3, 4, 5), 9, torch.float64, 0, True)
    out = ops.ks.ks_mm(blocks.cuda(), x.cuda(), bias.cuda())
    assert out.is_cuda and rel_err(out.cpu(), reference64(blocks, x, bias)) < 1e-12


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_chain_through_sparse_linear_matches_float64(dtype):
    from prunekit.deploy.runtime import SparseLinear
    from prunekit.formats.ks import encode_factors

    g = torch.Generator().manual_seed(5)
    factors = [
        (torch.randn(1, 2, 64, 32, generator=g) / 6).to(dtype),
        (torch.randn(2, 1, 32, 64, generator=g) / 8).to(dtype),
    ]
    dense = blocks_to_dense(factors[0]).double() @ blocks_to_dense(factors[1]).double()
    bias = torch.randn(128, generator=g).to(dtype)
    x = torch.randn(3, 50, 128, generator=g).to(dtype)
    layer = SparseLinear(encode_factors(factors), bias).cuda()
    out = layer(x.cuda())
    ref = torch.nn.functional.linear(x.double(), dense, bias.double())
    assert out.shape == (3, 50, 128) and out.dtype == dtype
    assert rel_err(out.cpu(), ref) < (1e-5 if dtype == torch.float32 else 4 * TOL[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_delta_block_kernel_matches_float64_on_poisoned_outputs(dtype):
    # batch-first, widths 8 (d = 8, 16, 32), 4 (d = 4, 12) and 2 (d = 2, 6): b over one 64-row tile and ragged, c
    # ragged (scalar W path) and a multiple of 8
    quads = [(1, 3, 5, 8), (2, 20, 33, 8), (1, 70, 16, 16), (3, 48, 192, 8), (1, 130, 64, 32), (2, 9, 24, 4),
             (1, 33, 40, 12), (3, 66, 17, 2), (2, 5, 24, 6)]  # fmt: skip
    for seed, quad in enumerate(quads):
        for n in (1, 37, 200):
            blocks, x, bias = case(quad, n, dtype, seed, True)
            blocks, x, bias = blocks.cuda(), x.cuda(), bias.cuda()
            ref = reference64(blocks.cpu(), x.cpu(), bias.cpu(), seed % 2 == 0)
            out = new_spmm_output(x, ref.shape[0]).fill_(float("nan"))
            ks.ks_mm_cuda(blocks, x, bias, "relu" if seed % 2 == 0 else "none", out=out, delta_block=True)
            torch.cuda.synchronize()
            assert rel_err(out.cpu(), ref) < TOL[dtype], (quad, n)


@pytest.mark.cuda
def test_cuda_default_path_takes_the_delta_block_kernel_where_the_rule_says_and_stays_exact():
    # (2, 64, 64, 16): width 8, c % 8 == 0 -> delta-block; (1, 96, 96, 4): width 4, min(b, c) > 64 -> tile kernel
    for seed, (quad, expect) in enumerate((((2, 64, 64, 16), True), ((1, 96, 96, 4), False), ((3, 40, 24, 4), True))):
        blocks, x, bias = case(quad, 77, torch.float16, seed, True)
        blocks, x, bias = blocks.cuda(), x.cuda(), bias.cuda()
        out = new_spmm_output(x, quad[0] * quad[1] * quad[3]).fill_(float("nan"))
        assert ks.uses_delta_block(blocks, x, out) is expect, quad
        ks.ks_mm_cuda(blocks, x, bias, "relu", out=out)
        torch.cuda.synchronize()
        assert rel_err(out.cpu(), reference64(blocks.cpu(), x.cpu(), bias.cpu(), True)) < 2e-3, quad


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("transposed", [False, True], ids=["batch_last", "batch_first"])
def test_cuda_default_path_runs_block_diagonal_factors_on_cublas_exactly(dtype, transposed):
    tol = 1e-5 if dtype == torch.float32 else 2e-3 if dtype == torch.float16 else 1.6e-2
    for seed, quad in enumerate(((3, 40, 24, 1), (1, 130, 70, 1), (8, 48, 48, 1))):
        blocks, x, bias = case(quad, 77, dtype, seed, transposed)
        blocks, x, bias = blocks.cuda(), x.cuda(), bias.cuda()
        out = new_spmm_output(x, quad[0] * quad[1]).fill_(float("nan"))
        ks.ks_mm_cuda(blocks, x, bias, "relu", out=out)
        torch.cuda.synchronize()
        assert rel_err(out.cpu(), reference64(blocks.cpu(), x.cpu(), bias.cpu(), True)) < tol, quad


@pytest.mark.cuda
def test_cuda_delta_block_kernel_refuses_what_it_cannot_take():
    blocks, x, bias = case((1, 8, 8, 3), 16, torch.float16, 0, True)
    with pytest.raises(ValueError, match="even d"):
        ks.ks_mm_cuda(blocks.cuda(), x.cuda(), delta_block=True)
    blocks, x, bias = case((1, 8, 8, 8), 16, torch.float16, 0, False)
    with pytest.raises(ValueError, match="batch-first"):
        ks.ks_mm_cuda(blocks.cuda(), x.cuda(), delta_block=True)


@pytest.mark.cuda
@pytest.mark.parametrize("transposed", [False, True], ids=["batch_last", "batch_first"])
def test_cuda_tf32x3_kernel_keeps_fp32_accuracy_on_poisoned_outputs(transposed):
    for seed, quad in enumerate(CUDA_QUADS):
        for n in (1, 37, 256):
            blocks, x, bias = case(quad, n, torch.float32, seed, transposed)
            blocks, x, bias = blocks.cuda(), x.cuda(), bias.cuda()
            ref = reference64(blocks.cpu(), x.cpu(), bias.cpu(), True)
            out = new_spmm_output(x, ref.shape[0]).fill_(float("nan"))
            ks.ks_mm_cuda(blocks, x, bias, "relu", out=out, tf32x3=True)
            torch.cuda.synchronize()
            nan = int(torch.isnan(out).sum())
            err = float((out.cpu().double().nan_to_num() - ref).norm() / ref.norm().clamp_min(1e-30))
            assert nan == 0 and err < 1e-5, (quad, n, f"nan {nan} of {out.numel()}", f"rel err {err:.2e}")  # TF32 ~1e-3
    with pytest.raises(ValueError, match="float32 only"):
        ks.ks_mm_cuda(blocks.half(), x.half(), tf32x3=True)
