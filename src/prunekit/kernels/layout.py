"""Output layout rule shared by the CPU, CUDA and fake implementations of ``prunekit::spmm_csr``.

nn.Linear activations are ``x2d: (tokens, in_features)``; the runtime passes ``x = x2d.t()``, a ``(K, N)`` view with
unit stride along K. For such an X the op returns ``Y: (M, N)`` as the transposed view of a contiguous ``(N, M)``
buffer, so that ``Y.t()`` is the contiguous ``(tokens, out_features)`` output of the layer and neither the input nor
the output needs a copy pass. Every other X gets a contiguous ``(M, N)`` Y. All three implementations apply this same
rule, so the fake (meta) outputs have the strides of the real ones. torch only.
"""

from __future__ import annotations

import torch


def transposed_io(x: torch.Tensor) -> bool:
    """True when ``x: (K, N)`` is column-major (the transposed view of a row-major ``(N, K)`` activation buffer)."""
    return x.dim() == 2 and x.shape[1] > 1 and x.stride(0) == 1 and x.stride(1) != 1


def new_spmm_output(x: torch.Tensor, m: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Uninitialised ``(m, N)`` output on ``x``'s device, laid out by :func:`transposed_io`."""
    dtype = dtype or x.dtype
    n = x.shape[1]
    if transposed_io(x):
        return torch.empty((n, m), dtype=dtype, device=x.device).t()
    return torch.empty((m, n), dtype=dtype, device=x.device)


def as_spmm_output(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``y: (M, N)`` copied into the layout :func:`new_spmm_output` gives for ``x`` (no copy when it already has it)."""
    out = new_spmm_output(x, y.shape[0], y.dtype)
    if out.stride() == y.stride():
        return y
    out.copy_(y)
    return out
