"""The memory report's GPU decode plan column (``deploy/report.py``): what the runtime adds beside a stored weight
when the layer runs at decode sizes on a GPU, counted on the CPU without building the plan."""

from __future__ import annotations

import torch

from prunekit import formats
from prunekit.deploy.report import LayerRow, Report, decode_plan_nbytes, render_markdown
from prunekit.kernels import nm24
from prunekit.kernels.spmm_bitmap_plan import build_bitmap_plan
from prunekit.kernels.testing import random_sparse_weight


def _csr(m, k, sparsity, dtype=torch.float16):
    return formats.encode("csr", random_sparse_weight(m, k, sparsity, dtype, "cpu"))


def test_csr_layers_that_auto_runs_on_the_bitmap_kernel_count_its_plan():
    enc = _csr(256, 2048, 0.9)
    c = enc.components
    plan = build_bitmap_plan(c["values"], c["row_offsets"], c["column_indices"], 256, 2048)
    assert decode_plan_nbytes(enc) == plan.buffer.numel() * 4
    # 1% dense: rowwarp at every N (M * K over gpu.BITMAP_SMALL_ELEMENTS; below it, with M or K <= 768, bitmap takes
    # 1% at N 9-16)
    assert decode_plan_nbytes(_csr(2048, 2048, 0.99)) is None
    assert decode_plan_nbytes(_csr(256, 2048, 0.99)) is not None
    assert decode_plan_nbytes(_csr(256, 512, 0.5)) is None  # K < 768: never bitmap
    assert decode_plan_nbytes(_csr(256, 2048, 0.9, torch.float32)) is None  # fp32: CUDA-core kernels only


def test_csr_plan_counted_where_only_the_wide_bitmap_rule_takes_it(monkeypatch):
    """The column asks the rule at N > 16 too (the bitmap kernel's range up to BITMAP_WIDE_MAX_N)."""
    from prunekit.kernels import gpu

    real = gpu.plan_spmm
    asked = []

    def only_wide(m, k, n, nnz, sms, variant, dtype):
        asked.append(n)
        return gpu.SpmmPlan("bitmap") if n == gpu.TC_MIN_N else real(m, k, n, nnz, sms, variant, dtype)

    monkeypatch.setattr(gpu, "plan_spmm", only_wide)
    enc = _csr(2048, 2048, 0.99)  # 1% dense, 4.2M elements: rowwarp at every N <= 16
    assert decode_plan_nbytes(enc) is not None
    assert gpu.BITMAP_MAX_N + 1 in asked and gpu.TC_MIN_N in asked


def test_two_four_layers_count_the_decode_plan_and_others_none():
    w = torch.randn(96, 256)
    w = w * torch.zeros_like(w).view(96, 64, 4).scatter_(2, w.view(96, 64, 4).abs().topk(2, 2).indices, 1).view(96, 256)
    enc = formats.encode("nm", w.half(), {"n": 2, "m": 4})
    assert decode_plan_nbytes(enc) == nm24.plan_nbytes(96, 256)
    assert decode_plan_nbytes(formats.encode("bsr", torch.zeros(64, 64).half(), {"block": (16, 16)})) is None


def test_markdown_shows_the_column_and_the_total():
    row = LayerRow("fc", [256, 2048], "unstructured", 0.9, 2 << 20, {}, "csr", 400_000, decode_plan_nbytes=300_000)
    text = render_markdown(Report("x", rows=[row], total_dense_nbytes=2 << 20, total_stored_nbytes=400_000))
    lines = text.splitlines()
    assert lines[4].endswith("| ratio | GPU decode plan |")
    assert lines[6].endswith("| 292.97 KiB |")
    assert "GPU decode plans, at decode sizes on a GPU: 292.97 KiB more, for 1 of the 1 pruned layers." in text
