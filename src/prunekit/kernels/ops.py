"""prunekit's torch.library custom ops: ``prunekit::spmm_csr``, ``prunekit::bsr_mm``, ``prunekit::nm_mm``.

Each op has a CPU implementation (the pure-torch reference in ``reference.py``) and a fake
(meta) implementation, so it runs eagerly, under ``torch.compile`` and in ``torch.export``.
CUDA implementations are registered by the compiled extension when it is available.
torch only: this package is copied into every exported package's ``runtime/``.
"""

from __future__ import annotations

import torch

from . import reference

__all__ = ["spmm_csr", "bsr_mm", "nm_mm"]


def _define(name: str, fn, fake):
    """Register ``prunekit::name`` once per process (a package runtime and prunekit may both import this)."""
    qualname = f"prunekit::{name}"
    try:
        op = torch.library.custom_op(qualname, mutates_args=(), device_types="cpu")(fn)
    except RuntimeError:
        return getattr(torch.ops.prunekit, name).default
    op.register_fake(fake)
    return op


def _spmm_csr(
    values: torch.Tensor,
    row_offsets: torch.Tensor,
    column_indices: torch.Tensor,
    row_indices: torch.Tensor,
    x: torch.Tensor,
    m: int,
    bias: torch.Tensor | None = None,
    activation: str = "none",
) -> torch.Tensor:
    return reference.spmm_csr(values, row_offsets, column_indices, row_indices, x, m, bias, activation)


def _spmm_csr_fake(values, row_offsets, column_indices, row_indices, x, m, bias=None, activation="none"):
    return x.new_empty((m, x.shape[1]))


def _bsr_mm(
    blocks: torch.Tensor,
    crow_indices: torch.Tensor,
    col_indices: torch.Tensor,
    x: torch.Tensor,
    m: int,
    bias: torch.Tensor | None = None,
    activation: str = "none",
) -> torch.Tensor:
    return reference.bsr_mm(blocks, crow_indices, col_indices, x, m, bias, activation)


def _bsr_mm_fake(blocks, crow_indices, col_indices, x, m, bias=None, activation="none"):
    return x.new_empty((m, x.shape[1]))


def _nm_mm(
    values: torch.Tensor,
    metadata: torch.Tensor,
    x: torch.Tensor,
    n: int,
    m_group: int,
    bits: int,
    bias: torch.Tensor | None = None,
    activation: str = "none",
) -> torch.Tensor:
    return reference.nm_mm(values, metadata, x, n, m_group, bits, bias, activation)


def _nm_mm_fake(values, metadata, x, n, m_group, bits, bias=None, activation="none"):
    return x.new_empty((values.shape[0], x.shape[1]))


spmm_csr = _define("spmm_csr", _spmm_csr, _spmm_csr_fake)
bsr_mm = _define("bsr_mm", _bsr_mm, _bsr_mm_fake)
nm_mm = _define("nm_mm", _nm_mm, _nm_mm_fake)
