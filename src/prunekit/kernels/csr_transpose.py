"""The transpose of a prunekit CSR weight, for the input gradient of ``prunekit::spmm_csr``.

``dX = A^T dY`` for ``Y = A X``. The input gradient runs prunekit's own SpMM kernels on ``A^T``, stored in the same
Sputnik layout (``formats/csr.py``), instead of scattering products with atomics. The pattern of ``A^T`` is computed
once per call from ``A``'s indices. It takes one stable sort of the non-zeros on ``A``'s device. The values then
follow through one gather (:func:`transposed_values`). torch only: this module ships in exported packages'
``runtime/``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats.csr import csr_layout, csr_rows
from .reference import csr_padding_mask
from .tensor_cache import cached

__all__ = ["TransposedCSR", "transpose_pattern", "cached_transpose_pattern", "transposed_values"]

_CACHE_ATTR = "_prunekit_csr_transpose"  # on the column_indices tensor (tensor_cache.cached)


@dataclass(frozen=True)
class TransposedCSR:
    """The pattern of ``A^T (K, M)`` in prunekit CSR, plus where its values come from in ``A``.

    Attributes:
        row_offsets: ``(K + 1,)`` int32; column_indices: ``(nnz_t_padded,)`` int16 when M <= 32767, else int32,
            padding repeating the row's last column; row_indices: ``(K,)`` int32 row swizzle (longest row first,
            stable); slots: ``(nnz,)`` int64 positions in ``A^T``'s values of ``A``'s real entries;
            sources: ``(nnz,)`` int64 positions of those entries in ``A``'s values; nnz_padded: ``A^T``'s stored
            entries, padding included.
    """

    row_offsets: torch.Tensor
    column_indices: torch.Tensor
    row_indices: torch.Tensor
    slots: torch.Tensor
    sources: torch.Tensor
    nnz_padded: int


def transpose_pattern(
    row_offsets: torch.Tensor, column_indices: torch.Tensor, k: int, dtype: torch.dtype
) -> TransposedCSR:
    """Pattern of ``A^T`` for ``A (M, K)`` in prunekit CSR, with values of ``dtype`` padded to 16-byte vectors.

    ``A``'s padding entries are found from the indices alone (``reference.csr_padding_mask``). A real entry whose
    stored value is 0 keeps its slot in ``A^T``.

    Args:
        row_offsets: ``(M + 1,)`` int32; column_indices: ``(nnz_padded,)`` int16/int32; k: K (columns of ``A``);
            dtype: the values' dtype (sets the padding width, ``formats.csr.vector_width``).

    Returns:
        :class:`TransposedCSR` on ``row_offsets``' device.

    Raises:
        ValueError: ``row_offsets`` and ``column_indices`` disagree, or a column index is outside ``[0, k)``.
    """
    m = row_offsets.numel() - 1
    cols = column_indices.long()
    if m < 0 or int(row_offsets[-1]) != cols.numel():
        raise ValueError(f"transpose_pattern: row_offsets end at {int(row_offsets[-1])}, {cols.numel()} columns given")
    if cols.numel() and (int(cols.min()) < 0 or int(cols.max()) >= k):
        raise ValueError(f"transpose_pattern: column indices must lie in [0, {k})")
    rows = csr_rows(row_offsets)
    sources = torch.nonzero(~csr_padding_mask(row_offsets, column_indices)).flatten()
    t_rows = cols[sources]  # A's column = A^T's row; stable sort keeps each A^T row's columns ascending
    order = torch.sort(t_rows, stable=True).indices
    sources, t_rows = sources[order], t_rows[order]
    t_cols = rows[sources]
    index, slots = csr_layout(t_rows, t_cols, k, m, dtype)
    return TransposedCSR(
        row_offsets=index["row_offsets"],
        column_indices=index["column_indices"],
        row_indices=index["row_indices"],
        slots=slots,
        sources=sources,
        nnz_padded=int(index["row_offsets"][-1]),
    )


def cached_transpose_pattern(
    row_offsets: torch.Tensor, column_indices: torch.Tensor, k: int, dtype: torch.dtype
) -> TransposedCSR:
    """:func:`transpose_pattern`, kept on ``column_indices`` and reused while neither index tensor has changed (same
    data pointers and version counters, same ``k`` and ``dtype``): a training loop's backward passes then sort the
    pattern once, not once per step."""
    return cached(
        column_indices,
        _CACHE_ATTR,
        (row_offsets, column_indices),
        (k, dtype),
        lambda: transpose_pattern(row_offsets, column_indices, k, dtype),
    )


def transposed_values(values: torch.Tensor, plan: TransposedCSR) -> torch.Tensor:
    """``A^T``'s ``(nnz_t_padded,)`` values from ``A``'s ``values: (nnz_padded,)``, padding 0, same dtype/device."""
    out = torch.zeros(plan.nnz_padded, dtype=values.dtype, device=values.device)
    out[plan.slots] = values[plan.sources]
    return out
