"""2:4 decode kernel (``kernels/nm24.py``, ``csrc/structured/nm24/nm24_decode.cu``).

CPU: the repacked plan replayed lane by lane (:func:`nm24.emulate`: byte permutes, fragment layouts) equals float64 on
odd shapes, empty rows and single-value groups; the chunk rule; the routing rule. CUDA: the kernel against float64
with NaN-poisoned outputs, N = 1..16, both X layouts and a strided X, fp16/bf16, bias + ReLU, one and many k-chunks,
calls in a row (the self-cleaning workspace), CUDA-graph replay, and the routes through ``nm_mm`` and SparseLinear.
"""

from __future__ import annotations

import pytest
import torch

from prunekit import formats
from prunekit.kernels import nm24, ops, reference, structured
from prunekit.kernels.testing import TOLERANCE, relative_error, spmm_reference64

pytestmark = pytest.mark.usefixtures("ring_kernel")  # conftest.py: the lean kernel only where a test sets it


def weight24(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """``(m, k)`` 2:4 weight (the 2 largest of every 4 N(0, 1) entries), row 1 empty, row 2 with one value per group."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(m, k // 4, 4, generator=g)
    keep = torch.zeros_like(w, dtype=torch.bool).scatter_(2, w.abs().topk(2, dim=2).indices, True)
    w = w * keep
    if m > 1:
        w[1] = 0
    if m > 2:
        first = w[2].abs().argmax(dim=-1, keepdim=True)
        w[2] = torch.zeros_like(w[2]).scatter_(-1, first, w[2].gather(-1, first))
    return w.reshape(m, k).to(dtype)


def encode24(dense: torch.Tensor):
    enc = formats.encode("nm", dense, {"n": 2, "m": 4})
    return enc.components["values"], enc.components["metadata"], int(enc.params["bits"])


EMULATE_CASES = [(1, 4, 1), (3, 12, 2), (37, 132, 5), (16, 128, 16), (200, 1000, 9), (130, 2056, 16)]


@pytest.mark.parametrize(("m", "k"), [(1, 4), (37, 132), (200, 1000), (130, 2056)])
def test_plan_nbytes_is_the_built_buffer(m, k):
    values, metadata, bits = encode24(weight24(m, k, torch.float16, seed=m))
    plan = nm24.build_plan(values, metadata, bits, k)
    assert nm24.plan_nbytes(m, k) == plan.buffer.numel() * 4


@pytest.mark.parametrize(("m", "k", "n"), EMULATE_CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("mma", "layout"), [("prmt", None), ("sp", "halves"), ("sp", "rows")])
def test_emulated_kernel_matches_float64(m, k, n, dtype, mma, layout):
    """The plan replayed as the kernel reads it: register expansion, or mma.sp metadata in either layout."""
    dense = weight24(m, k, dtype, seed=m + k)
    values, metadata, bits = encode24(dense)
    plan = nm24.build_plan(values, metadata, bits, k, mma=mma, sp_layout=layout)
    assert plan.variant == (mma == "sp") and plan.meta.numel() == plan.vals.shape[0] * plan.vals.shape[1] * 16
    assert (
        plan.vals.shape == (-(-m // 16), plan.vals.shape[1], 32, 4) and plan.vals.shape[1] * 2 % nm24.KSTEP_ALIGN == 0
    )
    assert plan.vals.shape[1] * 2 * 16 >= k > (plan.vals.shape[1] * 2 - nm24.KSTEP_ALIGN) * 16
    x = torch.randn(n, k).to(dtype).t()
    bias = torch.randn(m).to(dtype)
    for b, relu in ((None, False), (bias, True)):
        ref = spmm_reference64(dense, x, b, "relu" if relu else "none")
        assert torch.allclose(nm24.emulate(plan, x, b, relu), ref, rtol=1e-9, atol=1e-9)


def test_emulation_notices_a_wrong_selector(monkeypatch):
    """The replay depends on the selector table: swapping two of its entries breaks the result."""
    dense = weight24(32, 64, torch.float16)
    values, metadata, bits = encode24(dense)
    plan = nm24.build_plan(values, metadata, bits, 64, mma="prmt")
    x = torch.randn(64, 4).half()
    table = nm24.selector_table()
    monkeypatch.setattr(nm24, "selector_table", lambda: table[[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 15, 14]])
    assert not torch.allclose(nm24.emulate(plan, x), spmm_reference64(dense, x, None, "none"))


def test_selector_table_places_both_values():
    """For every pair i0 < i1 the permute puts value 0 at column i0, value 1 at i1, zero elsewhere."""
    table = nm24.selector_table()
    word = torch.tensor([0xBBBBAAAA], dtype=torch.int64)
    for i0 in range(4):
        for i1 in range(i0 + 1, 4):
            sel = table[i0 | (i1 << 2)]
            lo, hi = nm24._byte_perm(word, sel), nm24._byte_perm(word, sel >> 16)
            halves = [int(lo) & 0xFFFF, int(lo) >> 16, int(hi) & 0xFFFF, int(hi) >> 16]
            assert halves == [0xAAAA if c == i0 else 0xBBBB if c == i1 else 0 for c in range(4)]


def test_sp_meta_round_trip_and_bad_names():
    nibs = torch.randint(0, 16, (32, 16 * 4))
    for layout in nm24.SP_LAYOUTS:
        assert torch.equal(nm24.sp_meta_nibbles(nm24.sp_meta(nibs, 2, 16, layout), layout), nibs)
    with pytest.raises(ValueError, match="layout"):
        nm24.sp_meta(nibs, 2, 16, "columns")
    with pytest.raises(ValueError, match="variant"):
        nm24.mma_variant("wgmma")


def test_plan_rejects_other_dtypes_and_bad_k():
    dense = weight24(8, 16, torch.float32)
    values, metadata, bits = encode24(dense)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        nm24.build_plan(values, metadata, bits, 16)
    values, metadata, bits = encode24(dense.half())
    with pytest.raises(ValueError, match="do not match K"):
        nm24.build_plan(values, metadata, bits, 20)


def test_plan_chunk_rule(monkeypatch):
    # 32 k-steps while that leaves >= num_sms / 2 blocks, then 16, then 8; never more than K's k-steps
    assert nm24.plan_chunk(256, 256, 132) == 32  # 4096 x 4096: 32 row blocks x 8 chunks
    assert nm24.plan_chunk(688, 256, 132) == 32  # 11008 x 4096
    assert nm24.plan_chunk(256, 688, 132) == 32  # 4096 x 11008: 22 chunks (atomics, more than a cluster)
    assert nm24.plan_chunk(48, 192, 132) == 16  # 768 x 3072: 6 row blocks x 12 chunks
    assert nm24.plan_chunk(192, 48, 132) == 16  # 3072 x 768
    assert nm24.plan_chunk(4, 16, 132) == 8
    assert nm24.plan_chunk(1, 8, 132) == 8
    # the bitmap kernel's token groups (grid z: 64 tokens each above N = 32) count as blocks
    assert [nm24.token_groups(n) for n in (1, 16, 32, 33, 64, 65, 128, 256)] == [1, 1, 1, 1, 1, 2, 2, 4]
    assert nm24.plan_chunk(48, 192, 132, 64) == 16  # 768 x 3072, N = 64: one group, 6 x 6 blocks with 32 is too few
    assert nm24.plan_chunk(48, 192, 132, 128) == 32  # two groups: 6 x 6 x 2 = 72 blocks
    assert nm24.plan_chunk(48, 192, 132, 256) == 32
    assert nm24.plan_chunk(256, 256, 132, 256) == 32  # 4096 x 4096: 32 x 4 x 4 = 512 blocks at 64, under 4 per SM
    assert nm24.plan_chunk(688, 256, 132, 128) == 64  # 11008 x 4096, N = 128: 86 x 4 x 2 = 688 blocks at 64
    assert nm24.plan_chunk(688, 256, 132, 64) == 32  # one token group: 344 blocks at 64
    assert nm24.plan_chunk(256, 688, 132, 256) == 32  # 4096 x 11008: 11 chunks at 64, more than a portable cluster
    assert nm24.plan_chunk(1024, 1024, 132, 16) == 32  # never 64 at N <= 32 (the decode shapes' sweeps)
    monkeypatch.setenv(nm24.CHUNK_ENV, "60")
    assert nm24.plan_chunk(256, 256, 132) == 64
    monkeypatch.setenv(nm24.CHUNK_ENV, "200")
    assert nm24.plan_chunk(256, 256, 132) == nm24.MAX_CHUNK


def test_plan_ring_rule(monkeypatch):
    monkeypatch.delenv(nm24.RING_ENV, raising=False)
    assert nm24.plan_ring("sp") == (3, 8) and nm24.plan_ring("prmt") == (3, 8)
    monkeypatch.setenv(nm24.RING_ENV, "6x4")
    assert nm24.plan_ring("sp") == (6, 4)
    with pytest.raises(ValueError, match="3x8 ring only"):
        nm24.plan_ring("prmt")
    monkeypatch.setenv(nm24.RING_ENV, "5x8")
    with pytest.raises(ValueError, match="weight ring"):
        nm24.plan_ring("sp")
    values, metadata, bits = encode24(weight24(32, 128, torch.float16, 0))
    monkeypatch.setenv(nm24.RING_ENV, "4x4")
    plan = nm24.build_plan(values, metadata, bits, 128, mma="sp")
    assert (plan.ring, plan.batch) == (4, 4)


@pytest.mark.parametrize("mma", ["prmt", "sp"])
def test_plan_buffer_layout_matches_the_eager_entry(mma):
    """The eager entry (``nm24_linear`` in C++) finds vals, meta, ws and counters in the plan's one buffer from M and
    K alone: vals strips * ksteps * 64 words, meta strips * ksteps * 8, ws strips * 256, counters one per row block;
    the four plan fields are views of the buffer at those offsets, and cfg packs M, chunk, variant, ring, batch."""
    m, k = 37, 132
    values, metadata, bits = encode24(weight24(m, k, torch.float16, 3))
    plan = nm24.build_plan(values, metadata, bits, k, mma=mma)
    strips, ksteps = -(-m // 16), -(-k // 128) * 8
    sizes = [strips * ksteps * 64, strips * ksteps * 8, strips * 16 * 16, -(-strips // 8)]
    assert plan.buffer.dtype == torch.int32 and plan.buffer.numel() == sum(sizes)
    base, offset = plan.buffer.data_ptr(), 0
    for part, size in zip((plan.vals, plan.meta, plan.ws, plan.counters), sizes, strict=True):
        assert part.data_ptr() == base + 4 * offset and part.numel() == size
        offset += size
    assert float(plan.ws.abs().sum()) == 0.0 and int(plan.counters.abs().sum()) == 0
    cfg = plan.cfg | nm24.ROWS
    fields = (cfg & 0xFFFFFFFF, (cfg >> 32) & 0xFF, (cfg >> 40) & 1, (cfg >> 44) & 0xF, (cfg >> 48) & 0xF, cfg >> 56)
    assert fields == (m, plan.chunk, plan.variant, plan.ring, plan.batch, 1)


def test_decode_takes_rule(monkeypatch):
    values = torch.zeros(32, 32, dtype=torch.float16)
    x = torch.zeros(64, 16, dtype=torch.float16)
    assert not nm24.decode_takes(values, x, 2, 4)  # CPU tensors: the reference runs
    meta = torch.device("meta")
    xm, vm = x.to(meta), values.to(meta)
    assert not nm24.decode_takes(vm, xm, 2, 4)


def test_nm_mm_cuda_rejects_an_unknown_backend():
    dense = weight24(8, 16, torch.float16)
    values, metadata, bits = encode24(dense)
    with pytest.raises(ValueError, match="backend"):
        structured.nm_mm_cuda(values, metadata, torch.randn(16, 2).half(), 2, 4, bits, backend="fast")


# --- CUDA ----------------------------------------------------------------------------------------------------------

CUDA_CASES = [
    (1, 4, 1),
    (37, 132, 5),
    (128, 256, 16),
    (200, 1000, 9),
    (64, 8192, 16),  # few strips, long K: many k-chunks (64: atomics on sm_90 too)
    (128, 11008, 5),  # 86 k-chunks
    (4096, 64, 3),  # many strips, one k-chunk
    (1000, 3000, 8),
    (2048, 2048, 12),
]


def _cuda24(m, k, dtype, seed):
    dense = weight24(m, k, dtype, seed)
    values, metadata, bits = encode24(dense)
    return dense.cuda(), values.cuda(), metadata.cuda(), bits


def _run_mm(plan, x, bias, relu, y_layout):
    m, n = plan.m, x.shape[1]
    y = (
        torch.empty(n, m, device="cuda", dtype=x.dtype).t()
        if y_layout == "t"
        else torch.empty(m, n, device="cuda", dtype=x.dtype)
    )
    y.fill_(float("nan"))
    torch.ops.prunekit_nm24.mm.default(
        plan.vals,
        plan.meta,
        plan.ws,
        plan.counters,
        x,
        y,
        bias,
        relu,
        m,
        plan.chunk,
        plan.variant,
        plan.ring,
        plan.batch,
    )
    torch.cuda.synchronize()
    return y


def _set_reduction(monkeypatch, reduction: str) -> None:
    """How the kernel adds its k-chunks: "cluster" (sm_90 default), "atomics" (fence, counter, last block) or "finish"
    (atomics, then the finishing kernel)."""
    monkeypatch.setenv(nm24.CLUSTER_ENV, "1" if reduction == "cluster" else "0")
    monkeypatch.setenv(nm24.FINISH_ENV, "1" if reduction == "finish" else "0")


def _check_cases(dtype: torch.dtype, seed0: int):
    """The decode kernel (as the environment selects it) against float64 on every CUDA_CASES weight: N 1, 2, 7, 8, 9, 16;
    X as ``(N, K)`` transposed, ``(K, N)`` contiguous and a strided view; with and without bias + ReLU; NaN-poisoned
    outputs. Yields each case's plan after its calls."""
    assert nm24.available()
    for i, (m, k, _) in enumerate(CUDA_CASES):
        dense, values, metadata, bits = _cuda24(m, k, dtype, seed=seed0 + i)
        plan = nm24.get_plan(values, metadata, bits, k)
        bias = torch.randn(m, device="cuda").to(dtype)
        for n in (1, 2, 7, 8, 9, 16):
            for layout in ("nk", "kn", "strided"):
                x2d = torch.randn(n, k, device="cuda").to(dtype)
                x = {
                    "nk": x2d.t(),
                    "kn": x2d.t().contiguous(),
                    "strided": torch.randn(n, k + 3, device="cuda").to(dtype)[:, 1 : k + 1].t(),
                }[layout]
                for b, relu in ((None, False), (bias, True)):
                    y = _run_mm(plan, x, b, relu, "t" if layout == "nk" else "mn")
                    err = relative_error(y, spmm_reference64(dense, x, b, "relu" if relu else "none"))
                    assert err < TOLERANCE[dtype], (m, k, n, layout, relu, err)
        yield plan


@pytest.mark.cuda
@pytest.mark.parametrize(("mma", "ring"), [("prmt", "3x8"), ("sp", "3x8"), ("sp", "4x4"), ("sp", "6x4")])
@pytest.mark.parametrize("reduction", ["cluster", "atomics", "finish"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_kernel_matches_float64(dtype, reduction, mma, ring, monkeypatch):
    """Both inner products (register expansion + mma.sync, mma.sp), every ring depth and the three k-chunk reductions
    (thread-block clusters on sm_90, the default; global atomics with counters; global atomics finished by a second
    kernel)."""
    _set_reduction(monkeypatch, reduction)
    monkeypatch.setenv(nm24.MMA_ENV, mma)
    monkeypatch.setenv(nm24.RING_ENV, ring)
    for plan in _check_cases(dtype, seed0=0):
        assert f"{plan.ring}x{plan.batch}" == ring
        assert int(plan.counters.abs().sum()) == 0 and float(plan.ws.abs().sum()) == 0.0  # left clean


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("dtype", "warps", "pdl"),
    [(torch.float16, None, "1"), (torch.bfloat16, None, "1"), (torch.float16, None, "0")]
    + [(torch.float16, w, "1") for w in ("1", "2", "4", "6", "8", "1x2", "4x2")],
)
def test_lean_kernel_matches_float64(dtype, warps, pdl, monkeypatch):
    """The lean decode kernel ($PRUNEKIT_NM24_LEAN=1): KW warps per strip splitting K and SB strips per block (the
    launcher's choice, or "KW" / "KWxSB" forced; SB = 2 leaves the last block half empty where the strips are odd),
    with and without programmatic dependent launch, on the ring kernel's cases (odd M and K, empty rows, one value per
    group, N 1..16, three X layouts, bias + ReLU) into NaN-poisoned outputs."""
    monkeypatch.setenv(nm24.LEAN_ENV, "1")
    monkeypatch.setenv(nm24.MMA_ENV, "sp")
    monkeypatch.setenv("PRUNEKIT_NM24_PDL", pdl)
    if warps is None:
        monkeypatch.delenv(nm24.LEAN_WARPS_ENV, raising=False)
    else:
        monkeypatch.setenv(nm24.LEAN_WARPS_ENV, warps)
    for plan in _check_cases(dtype, seed0=100):
        assert int(plan.counters.abs().sum()) == 0 and float(plan.ws.abs().sum()) == 0.0  # the workspace is not used


@pytest.mark.cuda
def test_lean_kernel_shape_setting(monkeypatch):
    monkeypatch.setenv(nm24.LEAN_ENV, "1")
    monkeypatch.setenv(nm24.MMA_ENV, "sp")
    dense, values, metadata, bits = _cuda24(64, 256, torch.float16, seed=1)
    plan = nm24.get_plan(values, metadata, bits, 256)
    x = torch.randn(4, 256, device="cuda").half().t()
    for bad in ("3", "8x2", "2x3", "4junk", "4x2x", "4X2", "x2"):
        monkeypatch.setenv(nm24.LEAN_WARPS_ENV, bad)
        with pytest.raises(RuntimeError, match="PRUNEKIT_NM24_LEAN_WARPS"):
            _run_mm(plan, x, None, False, "t")
    for unset in ("", "auto"):  # the launcher's rule
        monkeypatch.setenv(nm24.LEAN_WARPS_ENV, unset)
        y = _run_mm(plan, x, None, False, "t")
        assert relative_error(y, spmm_reference64(dense, x, None, "none")) < TOLERANCE[torch.float16], unset


@pytest.mark.cuda
def test_lean_kernel_default_rule(monkeypatch):
    """$PRUNEKIT_NM24_LEAN unset or "auto": the lean kernel takes the 2:4 calls with K <= nm24.LEAN_MAX_K at N <= 16,
    and none at larger K; "1" takes those too, "0" none; another value raises. (An invalid $PRUNEKIT_NM24_LEAN_WARPS
    raises only in the lean kernels: it shows which calls they take.)"""
    monkeypatch.setenv(nm24.MMA_ENV, "sp")
    plans, weights = {}, {}
    for k in (nm24.LEAN_MAX_K - 24, nm24.LEAN_MAX_K + 76):
        weights[k], values, metadata, bits = _cuda24(64, k, torch.float16, seed=2)
        plans[k] = nm24.get_plan(values, metadata, bits, k)
    for setting in (None, "", "auto", "1", "0"):
        if setting is None:
            monkeypatch.delenv(nm24.LEAN_ENV, raising=False)
        else:
            monkeypatch.setenv(nm24.LEAN_ENV, setting)
        for k, plan in plans.items():
            takes = setting != "0" and (setting == "1" or k <= nm24.LEAN_MAX_K)
            for n in (2, 16):
                x = torch.randn(n, k, device="cuda").half().t()
                monkeypatch.setenv(nm24.LEAN_WARPS_ENV, "3")
                if takes:
                    with pytest.raises(RuntimeError, match="PRUNEKIT_NM24_LEAN_WARPS"):
                        _run_mm(plan, x, None, False, "t")
                else:
                    _run_mm(plan, x, None, False, "t")
                monkeypatch.delenv(nm24.LEAN_WARPS_ENV)
                y = _run_mm(plan, x, None, False, "t")  # and right, either kernel (NaN-poisoned output)
                err = relative_error(y, spmm_reference64(weights[k], x, None, "none"))
                assert err < TOLERANCE[torch.float16], (setting, k, n, err)
    monkeypatch.setenv(nm24.LEAN_ENV, "yes")
    with pytest.raises(RuntimeError, match="PRUNEKIT_NM24_LEAN must"):
        _run_mm(plans[nm24.LEAN_MAX_K - 24], torch.randn(8, nm24.LEAN_MAX_K - 24, device="cuda").half().t(), None,
                False, "t")  # fmt: skip


@pytest.mark.cuda
def test_lean_kernel_in_the_layer_and_graph_replay(monkeypatch):
    """SparseLinear's eager 2:4 decode call and a captured CUDA graph of it on the lean kernel."""
    from prunekit.deploy.runtime.sparse_linear import SparseLinear

    monkeypatch.setenv(nm24.LEAN_ENV, "1")
    monkeypatch.setenv(nm24.MMA_ENV, "sp")
    dense = weight24(3072, 768, torch.float16, seed=11)
    bias = torch.randn(3072).half()
    layer = SparseLinear(formats.encode("nm", dense, {"n": 2, "m": 4}), bias).cuda()
    ref_w, ref_b = dense.double().cuda(), bias.double().cuda()
    for lead in ((2,), (16,), (2, 5)):
        x = torch.randn(*lead, 768, device="cuda", dtype=torch.float16)
        with torch.inference_mode():
            y = layer(x)
        assert y.shape == (*lead, 3072)
        assert relative_error(y, x.double() @ ref_w.t() + ref_b) < TOLERANCE[torch.float16], lead
    static_x = torch.randn(16, 768, device="cuda", dtype=torch.float16)
    stream = torch.cuda.Stream()
    with torch.inference_mode():
        with torch.cuda.stream(stream):
            layer(static_x)  # warm-up off the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = layer(static_x)
        for _ in range(3):
            x = torch.randn(16, 768, device="cuda", dtype=torch.float16)
            static_x.copy_(x)
            static_y.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert relative_error(static_y, x.double() @ ref_w.t() + ref_b) < TOLERANCE[torch.float16]


@pytest.mark.cuda
@pytest.mark.parametrize("mma", ["prmt", "sp"])
@pytest.mark.parametrize("reduction", ["cluster", "atomics", "finish"])
def test_decode_kernel_calls_in_a_row_and_graph_replay(reduction, mma, monkeypatch):
    _set_reduction(monkeypatch, reduction)
    monkeypatch.setenv(nm24.MMA_ENV, mma)
    dense, values, metadata, bits = _cuda24(512, 4096, torch.float16, seed=7)  # several k-chunks
    plan = nm24.get_plan(values, metadata, bits, 4096)
    assert -(-plan.vals.shape[1] * 2 // plan.chunk) > 1
    xs = [torch.randn(16, 4096, device="cuda", dtype=torch.float16).t() for _ in range(3)]
    for x in xs:  # each call must start from a clean workspace
        y = nm24.decode_mm(values, metadata, x, bits)
        assert relative_error(y, spmm_reference64(dense, x, None, "none")) < TOLERANCE[torch.float16]
    static_x = xs[0].t().contiguous().t()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        nm24.decode_mm(values, metadata, static_x, bits)  # warm-up off the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = nm24.decode_mm(values, metadata, static_x, bits)
    for x in xs[1:] + xs[:1]:
        static_x.copy_(x)
        static_y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(static_y, spmm_reference64(dense, x, None, "none")) < TOLERANCE[torch.float16]


@pytest.mark.cuda
def test_nm_mm_routes_decode_shapes_to_the_kernel(monkeypatch):
    dense, values, metadata, bits = _cuda24(256, 512, torch.float16, seed=3)
    bias = torch.randn(256, device="cuda").half()
    for n in (1, 16):
        x = torch.randn(n, 512, device="cuda").half().t()
        y = ops.nm_mm(values, metadata, x, 2, 4, bits, bias, "relu")
        assert y.stride() == ops.nm_mm(values.cpu(), metadata.cpu(), x.cpu(), 2, 4, bits, bias.cpu(), "relu").stride()
        assert relative_error(y, spmm_reference64(dense, x, bias, "relu")) < TOLERANCE[torch.float16]
    assert getattr(values, nm24._PLAN_ATTR, None) is not None  # the decode plan was built
    monkeypatch.setenv(nm24.DECODE_ENV, "0")
    assert not nm24.decode_takes(values, x, 2, 4)


@pytest.mark.cuda
def test_sparse_linear_eager_decode():
    from prunekit.deploy.runtime.sparse_linear import SparseLinear

    dense = weight24(384, 768, torch.float16, seed=5)
    bias = torch.randn(384).half()
    layer = SparseLinear(formats.encode("nm", dense, {"n": 2, "m": 4}), bias).cuda()
    for lead in ((1,), (5,), (16,), (2, 3)):
        x = torch.randn(*lead, 768, device="cuda", dtype=torch.float16)
        with torch.inference_mode():
            y = layer(x)
        assert y.shape == (*lead, 384) and y.is_contiguous()
        ref = x.double() @ dense.double().cuda().t() + bias.double().cuda()
        assert relative_error(y, ref) < TOLERANCE[torch.float16], lead
    assert getattr(layer._buffers["w_values"], nm24._PLAN_ATTR, None) is not None


def test_sparse_linear_decode_route_on_cpu(monkeypatch):
    """The runtime's eager 2:4 decode call, with the CUDA launch replaced by the kernel's emulation: one launch per call,
    the plan built once and rebuilt after an in-place change of the weight, and the output layer-shaped."""
    from prunekit.deploy.runtime import sparse_linear
    from prunekit.deploy.runtime.sparse_linear import SparseLinear

    dense = weight24(48, 64, torch.float16, seed=2)
    bias = torch.randn(48).half()
    layer = SparseLinear(formats.encode("nm", dense, {"n": 2, "m": 4}), bias)
    launches, builds = [], []
    real_build = nm24.build_plan
    monkeypatch.setattr(sparse_linear, "_eager_cuda", lambda xt: True)
    monkeypatch.setattr(nm24, "decode_takes", lambda values, x, n, m_group: True)
    monkeypatch.setattr(nm24, "available", lambda: True)

    def build(*a, **k):
        builds.append(real_build(*a, **k))
        return builds[-1]

    monkeypatch.setattr(nm24, "build_plan", build)

    def launch(buffer, x, b, relu, cfg):  # prunekit_nm24::linear's arguments, as SparseLinear keeps them
        assert cfg == builds[-1].cfg | nm24.ROWS  # the activations (N, K) handed over as they are
        plan = next(p for p in builds if p.buffer is buffer)
        launches.append(x.shape)
        return nm24.emulate(plan, x.t(), b, relu).to(x.dtype).t()

    monkeypatch.setattr(nm24, "linear_entry", lambda: launch)
    for lead in ((1,), (7,), (2, 8)):
        x = torch.randn(*lead, 64).half()
        y = layer(x)
        assert y.shape == (*lead, 48)
        ref = x.double().reshape(-1, 64) @ dense.double().t() + bias.double()
        assert relative_error(y.reshape(-1, 48), ref) < TOLERANCE[torch.float16]
    assert launches == [(1, 64), (7, 64), (16, 64)] and len(builds) == 1  # one launch per call, one plan
    with torch.no_grad():
        layer.w_values.mul_(2)  # in place: the plan must be rebuilt
    x = torch.randn(3, 64).half()
    y = layer(x)
    ref = x.double() @ (2 * dense.double()).t() + bias.double()
    assert relative_error(y, ref) < TOLERANCE[torch.float16] and len(builds) == 2


def test_plan_is_kept_and_env_read_when_built(monkeypatch):
    dense = weight24(32, 64, torch.float16)
    values, metadata, bits = encode24(dense)
    monkeypatch.setenv(nm24.MMA_ENV, "prmt")
    plan = nm24.get_plan(values, metadata, bits, 64)
    assert plan.variant == 0 and nm24.get_plan(values, metadata, bits, 64) is plan
    monkeypatch.setenv(nm24.MMA_ENV, "sp")
    assert nm24.get_plan(values, metadata, bits, 64) is plan  # read when built, not per call
    nm24.drop_plan(values)
    assert nm24.get_plan(values, metadata, bits, 64).variant == 1
    values.mul_(1)  # an in-place write: rebuilt
    assert nm24.get_plan(values, metadata, bits, 64) is not plan


@pytest.mark.parametrize("mma", ["prmt", "sp"])
def test_plan_of_hand_made_metadata_with_repeated_or_unordered_indices(mma):
    """Metadata the encoder never writes: indices out of order, and both values at one index (the reference adds
    them). The plan must still reproduce the reference."""
    from prunekit.formats.nm import pack_indices

    m, k = 16, 32
    g = torch.Generator().manual_seed(4)
    values = torch.randn(m, k // 2, generator=g).half()
    idx = torch.randint(0, 4, (m, k // 2), generator=g)
    idx[0, 0:2] = torch.tensor([3, 1])  # unordered
    idx[1, 2:4] = torch.tensor([2, 2])  # repeated
    metadata = pack_indices(idx, 2)
    plan = nm24.build_plan(values, metadata, 2, k, mma=mma)
    x = torch.randn(k, 5).half()
    ref = reference.nm_mm(values.double(), metadata, x.double(), 2, 4, 2)
    assert relative_error(nm24.emulate(plan, x), ref) < TOLERANCE[torch.float16]
