"""Pure-torch reference of the Kronecker-sparse matmul ``prunekit::ks_mm`` (the CPU path and the test oracle).

A Kronecker-sparse factor ``K`` with pattern ``(a, b, c, d)`` (Gonon et al. 2024, "Fast inference with
Kronecker-sparse matrices", arXiv 2405.15013, section 2) is stored as ``blocks: (a, d, b, c)``
(``formats/ks.py``): ``K[(alpha*b + beta)*d + delta, (alpha*c + gamma)*d + delta] = blocks[alpha, delta, beta,
gamma]``. Then ``Y = K @ X`` for ``X: (a*c*d, N)`` is, with ``X`` viewed as ``(a, c, d, N)`` and ``Y`` as
``(a, b, d, N)``::

    Y[alpha, beta, delta, n] = sum_gamma blocks[alpha, delta, beta, gamma] * X[alpha, gamma, delta, n]

one einsum over the blocks, without the dense ``(a*b*d, a*c*d)`` matrix. Batch-first activations (``X`` the
column-major view ``x2d.t()`` of ``x2d: (N, a*c*d)``) are read as ``(N, a, c, d)`` and give the column-major ``Y``
of ``layout.py``; a row-major ``X`` (batch-last) gives a row-major ``Y``. Accumulation in float32 (float64 for
float64 inputs), output in ``X``'s dtype; ``N`` is processed in chunks so intermediates stay small.
torch only (copied into exported packages).
"""

from __future__ import annotations

import torch

from .layout import new_spmm_output, transposed_io
from .reference import CHUNK_ELEMENTS, _epilogue, accumulate_dtype

__all__ = ["ks_mm", "ks_chain_mm", "check_ks_args"]


def check_ks_args(blocks: torch.Tensor, x: torch.Tensor) -> tuple[int, int, int, int]:
    """``(a, b, c, d)`` of ``blocks: (a, d, b, c)`` after checking ``x: (a*c*d, N)``.

    Raises:
        ValueError: ``blocks`` is not 4-D or ``x`` is not 2-D with ``a*c*d`` rows.
    """
    if blocks.dim() != 4 or x.dim() != 2:
        raise ValueError(
            f"ks_mm: blocks must be (a, d, b, c) and x (K, N), got {tuple(blocks.shape)}, {tuple(x.shape)}"
        )
    a, d, b, c = (int(s) for s in blocks.shape)
    if x.shape[0] != a * c * d:
        raise ValueError(
            f"ks_mm: x has {x.shape[0]} rows, the factor (a={a}, b={b}, c={c}, d={d}) needs a*c*d={a * c * d}"
        )
    return a, b, c, d


def ks_mm(
    blocks: torch.Tensor,
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
) -> torch.Tensor:
    """``Y (a*b*d, N) = act(K @ X + bias[:, None])`` for one Kronecker-sparse factor (Gonon et al. 2024, sec. 2).

    Args:
        blocks: ``(a, d, b, c)`` float (fp32/fp16/bf16/fp64); x: ``(a*c*d, N)`` any strides, float;
            bias: ``(a*b*d,)`` or None; activation: ``"none"`` or ``"relu"``.

    Returns:
        ``Y (a*b*d, N)`` in ``x.dtype``, laid out by ``layout.new_spmm_output`` (column-major for ``x2d.t()``).

    Raises:
        ValueError: shapes that do not match, or an unknown activation.
    """
    a, b, c, d = check_ks_args(blocks, x)
    m, n = a * b * d, x.shape[1]
    acc = accumulate_dtype(x.dtype)
    w = blocks.to(acc)
    out = new_spmm_output(x, m)
    step = max(1, CHUNK_ELEMENTS // max(1, m + x.shape[0]))
    if transposed_io(x):
        x2d = x.t()  # (N, K) row-major
        for start in range(0, n, step):
            xs = x2d[start : start + step].to(acc).reshape(-1, a, c, d)
            ys = torch.einsum("adbc,nacd->nabd", w, xs).reshape(-1, m)
            out[:, start : start + step] = _epilogue(ys.t(), bias, activation, x.dtype)
        return out
    for start in range(0, n, step):
        xs = x[:, start : start + step].to(acc).reshape(a, c, d, -1)
        ys = torch.einsum("adbc,acdn->abdn", w, xs).reshape(m, -1)
        out[:, start : start + step] = _epilogue(ys, bias, activation, x.dtype)
    return out


def ks_chain_mm(
    factors: list[torch.Tensor],
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
) -> torch.Tensor:
    """``Y = act(K_1 @ ... @ K_L @ X + bias[:, None])``: factor after factor, ``K_L`` first; intermediates in
    ``x.dtype`` (as the GPU kernels write them), bias and activation after ``K_1``.

    Args:
        factors: blocks ``[(a_i, d_i, b_i, c_i), ...]``, ``K_1`` first; x: ``(K, N)``; bias: ``(M,)`` or None.
    """
    y = x
    for i, blk in enumerate(reversed(factors)):
        last = i == len(factors) - 1
        y = ks_mm(blk, y, bias if last else None, activation if last else "none")
    return y
