"""N:M matmul (``prunekit::nm_mm``): CPU reference and opcheck, and the CUDA 2:4 path (cuSPARSELt, weight compressed
once and cached) against float64 on fresh random inputs, odd N and both X layouts; other N:M patterns on CUDA fall
back to the reference and must still be right."""

from __future__ import annotations

import pytest
import torch

from prunekit import formats
from prunekit.kernels import ops, structured
from prunekit.kernels.testing import TOLERANCE, relative_error, spmm_reference64


def nm_weight(m: int, k: int, n: int, group: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """``(m, k)`` weight keeping the ``n`` largest-magnitude entries of every group of ``group`` (N(0, 1) values)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(m, k // group, group, generator=g)
    keep = torch.zeros_like(w, dtype=torch.bool).scatter_(2, w.abs().topk(n, dim=2).indices, True)
    return (w * keep).reshape(m, k).to(dtype)


def _encode(dense, n, group):
    enc = formats.encode("nm", dense, {"n": n, "m": group})
    return enc.components["values"], enc.components["metadata"], int(enc.params["bits"])


@pytest.mark.parametrize(("n", "group"), [(2, 4), (1, 4), (4, 8)])
@pytest.mark.parametrize("transposed", [False, True])
def test_nm_reference_matches_float64_and_layout_rule(n, group, transposed):
    dense = nm_weight(24, 64, n, group, torch.float32)
    values, metadata, bits = _encode(dense, n, group)
    x2d = torch.randn(7, 64)
    x = x2d.t() if transposed else x2d.t().contiguous()
    bias = torch.randn(24)
    y = ops.nm_mm(values, metadata, x, n, group, bits, bias, "relu")
    assert y.stride() == ((1, 24) if transposed else (7, 1))
    assert relative_error(y, spmm_reference64(dense, x, bias, "relu")) < 1e-6


@pytest.mark.parametrize("transposed", [False, True])
def test_opcheck_nm_mm_both_layouts(transposed):
    dense = nm_weight(8, 32, 2, 4, torch.float32)
    values, metadata, bits = _encode(dense, 2, 4)
    x2d = torch.randn(3, 32)
    x = x2d.t() if transposed else x2d.t().contiguous()
    torch.library.opcheck(ops.nm_mm, (values, metadata, x, 2, 4, bits, torch.randn(8), "relu"))


NM_CUDA_SHAPES = [(128, 256, 1), (256, 512, 16), (64, 128, 37), (512, 256, 300)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("backend", "output"), [("cslt", "col"), ("cslt", "row"), ("torch", None), ("auto", None)])
def test_nm24_cuda_matches_float64(dtype, backend, output):
    if not structured.cusparselt_available():
        pytest.skip("this torch has no cuSPARSELt")
    if backend == "cslt":
        assert structured.native_cslt_available()  # prunekit's own binding builds and loads on the GPU machine
    for i, (m, k, n_tokens) in enumerate(NM_CUDA_SHAPES):
        dense = nm_weight(m, k, 2, 4, dtype, seed=i)
        values, metadata, bits = (t.cuda() if isinstance(t, torch.Tensor) else t for t in _encode(dense, 2, 4))
        dense = dense.cuda()
        for transposed in (True, False):
            x2d = torch.randn(n_tokens, k, device="cuda").to(dtype)
            x = x2d.t() if transposed else x2d.t().contiguous()
            bias = torch.randn(m, device="cuda").to(dtype)
            for activation in ("none", "relu"):
                for with_bias in (True, False):
                    b = bias if with_bias else None
                    y = structured.nm_mm_cuda(
                        values, metadata, x, 2, 4, bits, b, activation, backend=backend, output=output
                    )
                    torch.cuda.synchronize()
                    assert y.shape == (m, n_tokens)
                    assert y.stride() == (ops.nm_mm(values, metadata, x, 2, 4, bits, b, activation).stride())
                    if transposed and n_tokens > 1:
                        assert y.t().is_contiguous()
                    err = relative_error(y, spmm_reference64(dense, x, b, activation))
                    assert err < TOLERANCE[dtype], (m, k, n_tokens, transposed, activation, with_bias, err)
        before = structured.compress_calls
        structured.nm_mm_cuda(values, metadata, x2d.t(), 2, 4, bits, backend=backend)
        assert structured.compress_calls == before  # compressed once, then reused
    if backend == "cslt":
        assert structured.native_cslt_available()  # no cuSPARSELt error made it fall back to torch's path


@pytest.mark.cuda
def test_nm24_cuda_with_the_plan_search_matches_float64(monkeypatch):
    """$PRUNEKIT_CSLT_SEARCH=1: each new cuSPARSELt plan is tuned once by cusparseLtMatmulSearch on its first call's
    operands (which it overwrites); the call's result, and the next call's, must still be right."""
    if not structured.cusparselt_available():
        pytest.skip("this torch has no cuSPARSELt")
    monkeypatch.setenv("PRUNEKIT_CSLT_SEARCH", "1")
    for i, (m, k, n_tokens) in enumerate(NM_CUDA_SHAPES):
        dense = nm_weight(m, k, 2, 4, torch.float16, seed=100 + i)  # a new weight: new plans, searched
        values, metadata, bits = (t.cuda() if isinstance(t, torch.Tensor) else t for t in _encode(dense, 2, 4))
        bias = torch.randn(m, device="cuda").half()
        for _ in range(2):
            x = torch.randn(n_tokens, k, device="cuda").half().t()
            y = structured.nm_mm_cuda(values, metadata, x, 2, 4, bits, bias, "relu", backend="cslt", output="row")
            err = relative_error(y, spmm_reference64(dense.cuda(), x, bias, "relu"))
            assert err < TOLERANCE[torch.float16], (m, k, n_tokens, err)
    assert structured.native_cslt_available()


@pytest.mark.cuda
@pytest.mark.parametrize("x_row", [False, True])
@pytest.mark.parametrize("y_row", [False, True])
@pytest.mark.parametrize("env", [{}, {"PRUNEKIT_CSLT_ALG": "1"}, {"PRUNEKIT_CSLT_SPLIT_K": "1"}])
def test_cslt_mm_operand_layouts_and_configurations(x_row, y_row, env, monkeypatch):
    """``prunekit_cslt::mm`` with X (K, N) and Y (M, N) in either order, and plans built with an explicit algorithm
    configuration or split-K (``benchmarks/nm_configs.py``): Y poisoned first, checked against float64."""
    if not structured.cusparselt_available():
        pytest.skip("this torch has no cuSPARSELt")
    assert structured.native_cslt_available()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    m, k, n_tokens = 256, 512, 48
    dense = nm_weight(m, k, 2, 4, torch.float16, seed=31).cuda()
    values, metadata, bits = (t.cuda() if isinstance(t, torch.Tensor) else t for t in _encode(dense.cpu(), 2, 4))
    state = structured.native_weight_24(values, metadata, bits, k)
    x2d = torch.randn(n_tokens, k, device="cuda").half()
    x = x2d.t().contiguous() if x_row else x2d.t()
    y = torch.empty(m, n_tokens, device="cuda").half() if y_row else torch.empty(n_tokens, m, device="cuda").half().t()
    y.fill_(float("nan"))
    torch.ops.prunekit_cslt.mm(state.id, x, y, None, False)
    torch.cuda.synchronize()
    assert relative_error(y, spmm_reference64(dense, x, None, "none")) < TOLERANCE[torch.float16]


@pytest.mark.cuda
@pytest.mark.parametrize(("env", "source"), [(None, 1), ("1", 1), ("0", 0)])
def test_cslt_configuration_search_is_on_by_default(env, source, monkeypatch):
    """The binding searches configurations unless ``$PRUNEKIT_CSLT_TUNE=0`` (``last_config``'s source 1 / 0), on a
    shape of its own per case (the search's choices are kept per shape for the process)."""
    if not structured.cusparselt_available():
        pytest.skip("this torch has no cuSPARSELt")
    assert structured.native_cslt_available()
    if env is None:
        monkeypatch.delenv("PRUNEKIT_CSLT_TUNE", raising=False)
    else:
        monkeypatch.setenv("PRUNEKIT_CSLT_TUNE", env)
    m, k = {None: (416, 576), "1": (448, 576), "0": (480, 576)}[env]
    dense = nm_weight(m, k, 2, 4, torch.float16, seed=53).cuda()
    wid = int(torch.ops.prunekit_cslt.prepare(dense))
    try:
        x2d = torch.randn(256, k, device="cuda").half()
        y = torch.empty(m, 256, device="cuda").half().fill_(float("nan"))
        torch.ops.prunekit_cslt.mm(wid, x2d.t(), y, None, False)
        torch.cuda.synchronize()
        assert relative_error(y, spmm_reference64(dense, x2d.t(), None, "none")) < TOLERANCE[torch.float16]
        assert int(torch.ops.prunekit_cslt.last_config(wid)[1]) == source
    finally:
        torch.ops.prunekit_cslt.release(wid)


@pytest.mark.cuda
@pytest.mark.parametrize("relu", [False, True])
def test_cslt_configuration_search_keeps_an_id_and_stays_right(relu, monkeypatch):
    """``$PRUNEKIT_CSLT_TUNE=1``: the first call of a plan at N >= 128 times cuSPARSELt's configuration ids
    (``last_config``: an id or -1 for the default selection, source 1); a new N in the same power-of-two bucket takes
    that choice without searching (source 2); a new bucket searches again; below N = 128, and for a plan first built
    inside a CUDA-graph capture, nothing is searched (source 0). Every output, bias and ReLU fused, matches float64
    with Y poisoned first."""
    if not structured.cusparselt_available():
        pytest.skip("this torch has no cuSPARSELt")
    assert structured.native_cslt_available()
    m, k = 352, 1088  # a shape no other test uses: the search's choices are kept per shape for the process
    dense = nm_weight(m, k, 2, 4, torch.float16, seed=47).cuda()
    bias = torch.randn(m, device="cuda").half()
    act = "relu" if relu else "none"
    monkeypatch.setenv("PRUNEKIT_CSLT_TUNE", "1")
    wid = int(torch.ops.prunekit_cslt.prepare(dense))
    try:
        seen = {}
        # 160 searches (bucket 256), again the same plan, 32 is below the search, 208 shares 160's bucket, 304 is
        # a new bucket (512); cuSPARSELt takes N in multiples of 16 (the entry pads, this raw call does not)
        for n_tokens, source in ((160, 1), (160, 1), (32, 0), (208, 2), (304, 1)):
            x2d = torch.randn(n_tokens, k, device="cuda").half()
            y = torch.empty(m, n_tokens, device="cuda").half().fill_(float("nan"))
            torch.ops.prunekit_cslt.mm(wid, x2d.t(), y, bias, relu)
            torch.cuda.synchronize()
            assert relative_error(y, spmm_reference64(dense, x2d.t(), bias, act)) < TOLERANCE[torch.float16]
            config, got = (int(v) for v in torch.ops.prunekit_cslt.last_config(wid))
            assert got == source and config >= -1 and (source or config == -1), (n_tokens, config, got)
            seen[n_tokens] = config
        assert seen[208] == seen[160] or seen[208] == -1  # the bucket's choice (-1 if this N does not offer it)
        # a plan first built inside a capture, in a bucket not searched yet (1024), is not searched
        x2d = torch.randn(1008, k, device="cuda").half()
        y = torch.empty(m, 1008, device="cuda").half()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                torch.ops.prunekit_cslt.mm(wid, x2d.t(), y, bias, relu)
        assert [int(v) for v in torch.ops.prunekit_cslt.last_config(wid)] == [-1, 0]
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(y, spmm_reference64(dense, x2d.t(), bias, act)) < TOLERANCE[torch.float16]
    finally:
        torch.ops.prunekit_cslt.release(wid)


@pytest.mark.cuda
def test_cslt_every_configuration_id_and_split_k_mode_it_accepts_is_right(monkeypatch):
    """``prunekit_cslt::max_alg_id`` reports cuSPARSELt's largest configuration id for a product; every id up to it,
    and split-K 2 under each ``cusparseLtSplitKMode_t`` value, either is refused at plan time with the binding's
    error or gives the float64 result (Y poisoned first). The default (id 0) must be accepted."""
    if not structured.cusparselt_available():
        pytest.skip("this torch has no cuSPARSELt")
    assert structured.native_cslt_available()
    m, k, n_tokens = 256, 1024, 64
    dense = nm_weight(m, k, 2, 4, torch.float16, seed=43).cuda()
    x2d = torch.randn(n_tokens, k, device="cuda").half()
    ref = spmm_reference64(dense, x2d.t(), None, "none")
    wid = int(torch.ops.prunekit_cslt.prepare(dense))
    accepted = []
    try:
        y = torch.empty(m, n_tokens, device="cuda").half()
        max_id = int(torch.ops.prunekit_cslt.max_alg_id(wid, x2d.t(), y))
        assert max_id >= 0
        settings = [{"PRUNEKIT_CSLT_ALG": str(i)} for i in range(max_id + 1)]
        settings += [{"PRUNEKIT_CSLT_SPLIT_K_MODE": str(mode), "PRUNEKIT_CSLT_SPLIT_K": "2"} for mode in range(1, 7)]
        for env in settings:
            for name, value in env.items():
                monkeypatch.setenv(name, value)
            y.fill_(float("nan"))
            try:
                torch.ops.prunekit_cslt.mm(wid, x2d.t(), y, None, False)
                torch.cuda.synchronize()
            except RuntimeError as exc:
                assert "cuSPARSELt call" in str(exc), env
                continue
            finally:
                for name in env:
                    monkeypatch.delenv(name)
            assert relative_error(y, ref) < TOLERANCE[torch.float16], env
            accepted.append(env)
    finally:
        torch.ops.prunekit_cslt.release(wid)
    assert {"PRUNEKIT_CSLT_ALG": "0"} in accepted


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("col", [False, True])
@pytest.mark.parametrize("x_row", [False, True])
@pytest.mark.parametrize("y_row", [False, True])
@pytest.mark.parametrize("relu", [False, True])
def test_cslt_mm_weight_as_the_b_operand(dtype, col, x_row, y_row, relu):
    """``prunekit_cslt::prepare_b``: W as cuSPARSELt's structured B operand (``Y^T = X^T @ W^T``), described either
    way, with X and Y in either order and ReLU fused: Y poisoned first, checked against float64 on fresh inputs."""
    if not structured.cusparselt_available():
        pytest.skip("this torch has no cuSPARSELt")
    assert structured.native_cslt_available()
    m, k, n_tokens = 192, 320, 48
    dense = nm_weight(m, k, 2, 4, dtype, seed=37).cuda()
    wid = int(torch.ops.prunekit_cslt.prepare_b(dense, col))
    try:
        x2d = torch.randn(n_tokens, k, device="cuda").to(dtype)
        x = x2d.t().contiguous() if x_row else x2d.t()
        y = torch.empty(m, n_tokens, device="cuda", dtype=dtype)
        if not y_row:
            y = torch.empty(n_tokens, m, device="cuda", dtype=dtype).t()
        y.fill_(float("nan"))
        torch.ops.prunekit_cslt.mm(wid, x, y, None, relu)
        torch.cuda.synchronize()
        ref = spmm_reference64(dense, x, None, "relu" if relu else "none")
        assert relative_error(y, ref) < TOLERANCE[dtype]
    finally:
        torch.ops.prunekit_cslt.release(wid)


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 16, 37, 300])
def test_cslt_linear_with_a_b_operand_weight_returns_the_contiguous_transpose(tokens):
    """The binding's entry on a ``prepare_b`` weight: Y (M, N) is the transposed view of a contiguous (N, M), for odd
    token counts too (X padded to 16 tokens); a bias is refused with a one-line error."""
    if not structured.cusparselt_available():
        pytest.skip("this torch has no cuSPARSELt")
    assert structured.native_cslt_available()
    m, k = 256, 512
    dense = nm_weight(m, k, 2, 4, torch.float16, seed=41).cuda()
    wid = int(torch.ops.prunekit_cslt.prepare_b(dense, False))
    try:
        x2d = torch.randn(tokens, k, device="cuda", dtype=torch.float16)
        y = torch.ops.prunekit_cslt.linear(wid, x2d.t(), None, False, 2)
        assert y.shape == (m, tokens)
        assert y.t().is_contiguous()
        assert relative_error(y, spmm_reference64(dense, x2d.t(), None, "none")) < TOLERANCE[torch.float16]
        with pytest.raises(RuntimeError, match="takes no bias"):
            torch.ops.prunekit_cslt.linear(wid, x2d.t(), torch.zeros(m, device="cuda").half(), False, 2)
    finally:
        torch.ops.prunekit_cslt.release(wid)


@pytest.mark.cuda
def test_nm_cuda_other_patterns_fall_back_correctly():
    dense = nm_weight(64, 128, 1, 4, torch.float16, seed=9)
    values, metadata, bits = _encode(dense, 1, 4)
    x2d = torch.randn(5, 128, device="cuda", dtype=torch.float16)
    y = ops.nm_mm(values.cuda(), metadata.cuda(), x2d.t(), 1, 4, bits)
    assert relative_error(y, spmm_reference64(dense.cuda(), x2d.t(), None, "none")) < TOLERANCE[torch.float16]


@pytest.mark.cuda
def test_opcheck_nm24_cuda():
    if not structured.cusparselt_available():
        pytest.skip("this torch has no cuSPARSELt")
    dense = nm_weight(128, 256, 2, 4, torch.float16, seed=4)
    values, metadata, bits = _encode(dense, 2, 4)
    x2d = torch.randn(32, 256, device="cuda", dtype=torch.float16)
    args = (values.cuda(), metadata.cuda(), x2d.t(), 2, 4, bits, torch.randn(128, device="cuda").half(), "relu")
    torch.library.opcheck(ops.nm_mm, args)


@pytest.mark.cuda
@pytest.mark.parametrize("output", ["row", "col", "view"])
def test_sparse_linear_eager_24_through_the_binding_both_output_layouts(output, monkeypatch):
    """The runtime's eager 2:4 call (prunekit_cslt::linear) in each output layout, odd token counts: "view" returns
    cuSPARSELt's row-major output as a non-contiguous view where the binding runs (N > 16)."""
    monkeypatch.setenv(structured.EAGER_CPP_ENV, "1")
    if not structured.cusparselt_available():
        pytest.skip("this torch has no cuSPARSELt")
    from prunekit.deploy.runtime.sparse_linear import SparseLinear

    monkeypatch.setenv(structured.CSLT_OUTPUT_ENV, output)
    dense = nm_weight(256, 512, 2, 4, torch.float16, seed=11)
    bias = torch.randn(256).half()
    layer = SparseLinear(formats.encode("nm", dense, {"n": 2, "m": 4}), bias).cuda()
    for tokens in (1, 16, 37, 300):
        x = torch.randn(2, tokens, 512, device="cuda", dtype=torch.float16)
        y = layer(x)
        assert y.shape == (2, tokens, 256)
        assert y.is_contiguous() == (output != "view" or 2 * tokens <= 16), tokens
        ref = x.double().reshape(-1, 512) @ dense.double().cuda().t() + bias.double().cuda()
        assert relative_error(y.reshape(-1, 256), ref) < TOLERANCE[torch.float16], tokens
    # the binding's C++ entry in this layout for N > 16; the decode kernel at N <= 16
    assert layer._eager_plans[(torch.float16, torch.float16)] == structured.CSLT_OUTPUTS[output]
    assert layer._eager_plans[(torch.float16, torch.float16, "decode")] is not None  # (weight stamp, op, buffer, cfg)


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [48, 37, 300])
def test_sparse_linear_24_chain_reads_the_view_in_place(tokens, monkeypatch):
    """Two 2:4 layers in a row with the default eager output ("view"): the second reads the first's non-contiguous
    output (a row-major X) in place where N is a multiple of 16, else through the padded copy; both right vs float64."""
    if not structured.cusparselt_available():
        pytest.skip("this torch has no cuSPARSELt")
    from prunekit.deploy.runtime.sparse_linear import SparseLinear

    monkeypatch.delenv(structured.CSLT_OUTPUT_ENV, raising=False)
    monkeypatch.setenv(structured.EAGER_CPP_ENV, "1")
    w1 = nm_weight(256, 512, 2, 4, torch.float16, seed=41)
    w2 = nm_weight(128, 256, 2, 4, torch.float16, seed=42)
    b1, b2 = torch.randn(256).half(), torch.randn(128).half()
    l1 = SparseLinear(formats.encode("nm", w1, {"n": 2, "m": 4}), b1).cuda()
    l2 = SparseLinear(formats.encode("nm", w2, {"n": 2, "m": 4}), b2).cuda()
    x = torch.randn(tokens, 512, device="cuda", dtype=torch.float16)
    h = l1(x)
    assert h.stride(0) == 1 and not h.is_contiguous()  # cuSPARSELt's row-major (256, tokens), viewed
    y = l2(h)
    h64 = x.double() @ w1.double().cuda().t() + b1.double().cuda()
    ref = h64 @ w2.double().cuda().t() + b2.double().cuda()
    assert relative_error(y, ref) < 2 * TOLERANCE[torch.float16]
    assert l2._eager_plans[(torch.float16, torch.float16)] == structured.CSLT_OUTPUTS["view"]
