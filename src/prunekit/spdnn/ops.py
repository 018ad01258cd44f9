"""``prunekit::spdnn_layer``: one fused challenge layer, Y = min(max(Y W + b on non-zeros, 0), cap).

Registered as a torch.library custom op with a pure-torch implementation (torch.sparse CSR; it serves
both CPU and CUDA, and is the oracle) and a fake impl. The weights come as W^T in CSR, one row per
output neuron listing its input neurons, the layout in which the 2020 champion kept weights in
registers per output (Hidayetoglu et al. 2020).
"""

from __future__ import annotations

import warnings

import torch

from .generator import SPDNN_RELU_CAP


def spdnn_layer_reference(
    y: torch.Tensor,
    row_offsets: torch.Tensor,
    column_indices: torch.Tensor,
    values: torch.Tensor,
    bias: float,
    cap: float,
) -> torch.Tensor:
    """``y: (batch, N)``; W^T CSR ``row_offsets (N+1,)``, ``column_indices (nnz,)``, ``values (nnz,)`` -> ``(batch, N)``."""
    n = row_offsets.numel() - 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "sparse CSR support is in beta"
        w_t = torch.sparse_csr_tensor(
            row_offsets.to(torch.int64),
            column_indices.to(torch.int64),
            values.to(y.dtype),
            (n, y.shape[1]),
            check_invariants=False,
        )
    z = (w_t @ y.t()).t()
    z = torch.where(z != 0, z + bias, z)
    return z.clamp(0.0, cap).contiguous()


def _define():
    try:
        op = torch.library.custom_op("prunekit::spdnn_layer", mutates_args=(), device_types=("cpu", "cuda"))(_impl)
    except RuntimeError:
        return torch.ops.prunekit.spdnn_layer.default
    op.register_fake(
        lambda y, row_offsets, column_indices, values, bias, cap=SPDNN_RELU_CAP: y.new_empty(
            (y.shape[0], row_offsets.shape[0] - 1)
        )
    )
    return op


def _impl(
    y: torch.Tensor,
    row_offsets: torch.Tensor,
    column_indices: torch.Tensor,
    values: torch.Tensor,
    bias: float,
    cap: float = SPDNN_RELU_CAP,
) -> torch.Tensor:
    return spdnn_layer_reference(y, row_offsets, column_indices, values, bias, cap)


spdnn_layer = _define()
