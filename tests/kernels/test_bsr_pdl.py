"""Programmatic dependent launch of the BSR kernels: the lean decode kernel (``csrc/structured/bsr_decode_lean.cu``,
N <= 16 here: 64-row blocks, and 16- and 32-row blocks below its 32) and the wgmma kernels (``bsr_mm_wgmma.cuh``).

By default on sm_90 (``$PRUNEKIT_BSR_PDL=0`` turns it off) a kernel may start while the preceding kernel in the
stream still runs, and waits for it before it reads or writes anything: the pattern, X and even a static call's
indices may be that kernel's output. These tests chain layers, each reading the output the previous launch wrote
(poisoned with NaN before), with no synchronisation between the launches, eagerly and in a CUDA graph, with PDL on,
off and unset, and compare every stage against float64 on the input it was given: a kernel that read X early would
see NaN or an older value. In dynamic mode the blocks and column indices are rewritten by the kernel right before
each call; in static mode int64 indices make the op convert them in a kernel right before the call.
"""

from __future__ import annotations

import pytest
import torch

from prunekit import formats
from prunekit.kernels import structured
from prunekit.kernels.testing import TOLERANCE, relative_error, spmm_reference64

pytestmark = pytest.mark.cuda

WIDTH = 2048  # square layers: each output is the next layer's input


def _layer(r: int, c: int, seed: int) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """A WIDTH x WIDTH fp16 weight with 20% of its r x c blocks kept and block row 1 dense, its BSR components on the
    GPU and a bias."""
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float16
    keep = torch.rand(WIDTH // r, WIDTH // c, generator=g) < 0.2
    keep[1] = True  # a dense block row: static schedules split it (fp32 workspace, atomics, finalize kernel)
    mask = keep.repeat_interleave(r, 0).repeat_interleave(c, 1)
    dense = (torch.randn(WIDTH, WIDTH, generator=g) * mask * (WIDTH * 0.2) ** -0.5 * 2).to(dtype)
    comp = formats.encode("bsr", dense, {"block_rows": r, "block_cols": c}).components
    bias = (0.1 * torch.randn(WIDTH, generator=g)).to(dtype)
    return dense.cuda(), {key: t.cuda() for key, t in comp.items()}, bias.cuda()


def _call(comp: dict, x: torch.Tensor, out: torch.Tensor, bias: torch.Tensor, static: bool) -> torch.Tensor:
    sched = (comp["schedule"], comp["split_rows"]) if static else (None, None)
    return structured.bsr_mm_cuda(
        comp["blocks"], comp["crow_indices"], comp["col_indices"], x, WIDTH, bias, "relu", *sched, out=out
    )


def _outputs(count: int, n: int, dtype: torch.dtype = torch.float16) -> list[torch.Tensor]:
    """(WIDTH, n) views of contiguous (n, WIDTH) buffers: the runtime's layout, K-contiguous for the next layer."""
    return [torch.empty(n, WIDTH, device="cuda", dtype=dtype).t() for _ in range(count)]


def _set_pdl(pdl: str | None, monkeypatch) -> None:
    monkeypatch.setenv(structured.LEAN_ENV, "1")
    if pdl is None:
        monkeypatch.delenv(structured.PDL_ENV, raising=False)
    else:
        monkeypatch.setenv(structured.PDL_ENV, pdl)  # read at each launch


def _check_chain(r: int, c: int, static: bool, n: int) -> None:
    """Four layers chained three times, outputs NaN-poisoned first, no synchronisation between the launches; each
    stage against float64 on the input it was given."""
    layers = [_layer(r, c, seed) for seed in range(4)]
    x0 = torch.randn(n, WIDTH, device="cuda", dtype=torch.float16).t()
    outs = _outputs(len(layers), n)
    for _ in range(3):
        for out in outs:
            out.fill_(float("nan"))
        x = x0
        for (_, comp, bias), out in zip(layers, outs, strict=True):
            x = _call(comp, x, out, bias, static)
        torch.cuda.synchronize()
        inputs = [x0, *outs[:-1]]
        for i, ((dense, _, bias), x, out) in enumerate(zip(layers, inputs, outs, strict=True)):
            assert not torch.isnan(out).any(), i
            assert relative_error(out, spmm_reference64(dense, x, bias, "relu")) <= TOLERANCE[torch.float16], i


@pytest.mark.parametrize(("r", "c"), [(64, 64), (32, 32), (16, 16), (64, 16)])
@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("pdl", ["1", "0", None])
@pytest.mark.parametrize("n", [1, 16, 32, 300])
def test_chained_layers_read_the_previous_output(r, c, static, pdl, n, monkeypatch):
    """N <= 16: the lean kernel; 32: lean for 16- and 32-row blocks, wgmma for 64; 300: wgmma."""
    _set_pdl(pdl, monkeypatch)
    _check_chain(r, c, static, n)


@pytest.mark.parametrize(("r", "c"), [(16, 16), (32, 64)])
@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("pdl", ["1", "0"])
def test_chained_layers_through_the_x_slab_copy(r, c, static, pdl, monkeypatch):
    """The wgmma kernel reading X from the per-call slab copy ($PRUNEKIT_BSR_XSLABS=1: a kernel of its own between
    the preceding layer and this one)."""
    _set_pdl(pdl, monkeypatch)
    monkeypatch.setenv(structured.XSLABS_ENV, "1")
    _check_chain(r, c, static, 300)


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("pdl", ["1", "0"])
@pytest.mark.parametrize("n", [16, 128])
def test_chained_layers_in_a_cuda_graph(static, pdl, n, monkeypatch):
    _set_pdl(pdl, monkeypatch)
    layers = [_layer(64, 64, seed) for seed in range(3)]
    x0 = torch.randn(n, WIDTH, device="cuda", dtype=torch.float16).t()
    outs = _outputs(len(layers), n)

    def chain():
        x = x0
        for (_, comp, bias), out in zip(layers, outs, strict=True):
            x = _call(comp, x, out, bias, static)

    chain()  # plans and caches exist before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for out in outs:
            out.fill_(float("nan"))
        chain()
    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x0.copy_(torch.randn(WIDTH, n, generator=g, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        inputs = [x0, *outs[:-1]]
        for i, ((dense, _, bias), x, out) in enumerate(zip(layers, inputs, outs, strict=True)):
            assert relative_error(out, spmm_reference64(dense, x, bias, "relu")) <= TOLERANCE[torch.float16], (seed, i)


@pytest.mark.parametrize("pdl", ["1", "0"])
@pytest.mark.parametrize("n", [16, 128])
def test_dynamic_mode_reads_a_pattern_the_preceding_kernel_wrote(pdl, n, monkeypatch):
    """Dynamic mode: blocks and column indices copied in by the kernel right before the call (same block counts per
    row), with a long kernel before that; the call must use the new pattern and values."""
    _set_pdl(pdl, monkeypatch)
    _, comp, bias = _layer(32, 32, 0)
    x = torch.randn(n, WIDTH, device="cuda", dtype=torch.float16).t()
    busy = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    for seed in range(1, 4):
        # the new pattern with the old row lengths: take each row's first blocks of a fresh random column order
        crow = comp["crow_indices"].long().cpu()
        g = torch.Generator().manual_seed(seed)
        cols = torch.cat([torch.randperm(WIDTH // 32, generator=g)[: int(crow[i + 1] - crow[i])].sort().values
                          for i in range(WIDTH // 32)]).to(torch.int32)  # fmt: skip
        blocks = torch.randn(cols.numel(), 32, 32, generator=g).to(torch.float16)
        dense = torch.zeros(WIDTH, WIDTH, dtype=torch.float16)
        for i in range(WIDTH // 32):
            for j in range(int(crow[i]), int(crow[i + 1])):
                col = int(cols[j])
                dense[i * 32 : (i + 1) * 32, col * 32 : (col + 1) * 32] = blocks[j]
        blocks_gpu, cols_gpu = blocks.cuda(), cols.cuda()
        out = _outputs(1, n)[0].fill_(float("nan"))
        busy @ busy  # a long kernel first, so that an early read would land before the copies
        comp["blocks"][: blocks.shape[0]].copy_(blocks_gpu)
        comp["col_indices"][: cols.numel()].copy_(cols_gpu)
        _call(comp, x, out, bias, static=False)
        torch.cuda.synchronize()
        ref = spmm_reference64(dense.cuda(), x, bias, "relu")
        assert relative_error(out, ref) <= TOLERANCE[torch.float16], seed


@pytest.mark.parametrize("n", [16, 128])
def test_an_invalid_setting_raises(n, monkeypatch):
    _set_pdl("2", monkeypatch)
    _, comp, bias = _layer(64, 64, 0)
    x = torch.randn(n, WIDTH, device="cuda", dtype=torch.float16).t()
    with pytest.raises(RuntimeError, match="PRUNEKIT_BSR_PDL"):
        _call(comp, x, _outputs(1, n)[0], bias, static=True)


@pytest.mark.parametrize("pdl", ["1", "0"])
@pytest.mark.parametrize("n", [16, 32, 128])
@pytest.mark.parametrize("entry", ["python", "cpp"])
def test_static_mode_reads_indices_converted_right_before(pdl, n, entry, monkeypatch):
    """Static mode with int64 indices, schedule and split rows: the Python launcher (``_int32``) and the C++ entry
    (``as_int``) convert them in kernels of their own right before the BSR kernel, after a long matmul; the kernel
    must read the converted ones (it waits for the preceding kernel before it reads anything)."""
    _set_pdl(pdl, monkeypatch)
    busy = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    for r, seed in ((32, 1), (64, 2)):
        dense, comp, bias = _layer(r, r, seed)
        wide = {key: (t.long() if key != "blocks" else t) for key, t in comp.items()}
        x = torch.randn(n, WIDTH, device="cuda", dtype=torch.float16).t()
        ref = spmm_reference64(dense, x, bias, "relu")
        for _ in range(2):
            busy @ busy  # a long kernel first, so that an early read would land before the conversions
            if entry == "python":
                out = _outputs(1, n)[0].fill_(float("nan"))
                _call(wide, x, out, bias, static=True)
            else:
                out = structured.bsr_mm_eager(
                    wide["blocks"], wide["crow_indices"], wide["col_indices"], x, WIDTH, bias, "relu",
                    wide["schedule"], wide["split_rows"],
                )  # fmt: skip
            torch.cuda.synchronize()
            assert relative_error(out, ref) <= TOLERANCE[torch.float16], (r, n, entry)
