"""CSR in the layout of Sputnik's SpMM (Gale et al., SC 2020, sections 4-5).

Components of a weight ``(M, K) = (out_features, in_features)``:

- ``values``: ``(nnz_padded,)`` weight dtype. Each row's non-zeros (ascending column)
  are padded with zeros to a multiple of ``vector_width`` = 16 bytes / element size,
  so a kernel can load every row with 16-byte vector instructions (Sputnik sec. 5.2).
- ``row_offsets``: ``(M + 1,)`` int32, offsets of each row into ``values``.
- ``column_indices``: ``(nnz_padded,)`` int16 when K <= 32767, else int32. Padding entries
  repeat the row's last real column (value 0, so they add nothing).
- ``row_indices``: ``(M,)`` int32, rows ordered by non-zeros, longest first: Sputnik's row
  swizzle load balance (sec. 5.3). It is an execution order; storage stays row-major.
"""

from __future__ import annotations

import torch

from .base import EncodedTensor, SparseFormat, dtype_name, register

INT16_MAX_COLUMNS = 32767  # largest K whose column indices fit int16
VECTOR_BYTES = 16  # Sputnik sec. 5.2: 128-bit vector memory instructions


def vector_width(dtype: torch.dtype) -> int:
    """Elements per 16-byte vector load for a value dtype (fp32: 4, fp16/bf16: 8)."""
    return max(1, VECTOR_BYTES // torch.empty((), dtype=dtype).element_size())


def csr_rows(row_offsets: torch.Tensor) -> torch.Tensor:
    """Row index of every stored entry, ``(nnz_padded,)`` int64, from ``row_offsets: (M + 1,)``."""
    counts = (row_offsets[1:] - row_offsets[:-1]).long()
    return torch.repeat_interleave(torch.arange(counts.numel(), device=row_offsets.device), counts)


def csr_to_dense(
    values: torch.Tensor, row_offsets: torch.Tensor, column_indices: torch.Tensor, m: int, k: int
) -> torch.Tensor:
    """The matrix the CSR components hold: ``(M, K)`` in ``values.dtype`` on ``values``' device (the format's decoding,
    and ``kernels.reference``'s for ``prunekit::csr_to_dense``). Entries on one position add up, so the padding entries
    (zeros on a real column) leave it exact; the CUDA kernel (``csrc/spmm_dense.cu``) takes the format's invariant
    instead (columns unique within a row apart from zero padding) and agrees with this wherever it holds.

    Args:
        values: ``(nnz_padded,)``; row_offsets: ``(M + 1,)`` int32; column_indices: ``(nnz_padded,)`` int16/int32;
            m: M; k: K.
    """
    dense = torch.zeros((m, k), dtype=values.dtype, device=values.device)
    dense.index_put_((csr_rows(row_offsets), column_indices.long()), values, accumulate=True)
    return dense


def csr_layout(
    rows: torch.Tensor, cols: torch.Tensor, m: int, k: int, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The index components of the prunekit CSR holding entries ``(rows[i], cols[i])``, and where each entry's value
    goes in ``values``.

    Args:
        rows, cols: ``(nnz,)`` int64, in row-major order (by row, columns ascending within a row, no repeats); m, k:
            the matrix shape; dtype: the values' dtype (sets the padding width, :func:`vector_width`).

    Returns:
        ``({"row_offsets": (M + 1,) int32, "column_indices": (nnz_padded,) int16/int32, "row_indices": (M,) int32},
        slots)`` on ``rows``' device, with ``slots: (nnz,)`` int64 positions in the ``(nnz_padded,)`` values; the
        padding entries repeat their row's last column and hold value 0 (module docstring).
    """
    device = rows.device
    width = vector_width(dtype)
    nnz_per_row = torch.bincount(rows, minlength=m) if rows.numel() else torch.zeros(m, dtype=torch.long, device=device)
    padded_per_row = (nnz_per_row + width - 1) // width * width
    row_offsets = torch.zeros(m + 1, dtype=torch.int64, device=device)
    row_offsets[1:] = torch.cumsum(padded_per_row, 0)
    real_starts = torch.cumsum(nnz_per_row, 0) - nnz_per_row
    slots = row_offsets[rows] + torch.arange(rows.numel(), device=device) - real_starts[rows]
    last_col = torch.zeros(m, dtype=torch.int64, device=device)
    if rows.numel():
        last_col.scatter_reduce_(0, rows, cols, reduce="amax")
    column_indices = last_col[csr_rows(row_offsets)]
    column_indices[slots] = cols
    index_dtype = torch.int16 if k <= INT16_MAX_COLUMNS else torch.int32
    components = {
        "row_offsets": row_offsets.to(torch.int32),
        "column_indices": column_indices.to(index_dtype),
        "row_indices": torch.sort(nnz_per_row, descending=True, stable=True).indices.to(torch.int32),
    }
    return components, slots


@register
class CSR(SparseFormat):
    """Sputnik-style CSR; see the module docstring for the component layout."""

    name = "csr"

    def encode(self, dense: torch.Tensor, params: dict[str, int | str]) -> EncodedTensor:
        self.check(dense, params)
        m, k = dense.shape
        rows, cols = torch.nonzero(dense, as_tuple=True)  # row-major
        index, slots = csr_layout(rows, cols, m, k, dense.dtype)
        values = torch.zeros(int(index["row_offsets"][-1]), dtype=dense.dtype)
        values[slots] = dense[rows, cols]
        components = {"values": values, **index}
        width = vector_width(dense.dtype)
        return EncodedTensor(self.name, (m, k), dtype_name(dense.dtype), {"vector_width": width}, components)

    def decode(self, encoded: EncodedTensor) -> torch.Tensor:
        c = encoded.components
        m, k = encoded.shape
        return csr_to_dense(c["values"].to(encoded.torch_dtype), c["row_offsets"], c["column_indices"], m, k)
