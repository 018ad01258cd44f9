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


@register
class CSR(SparseFormat):
    """Sputnik-style CSR; see the module docstring for the component layout."""

    name = "csr"

    def encode(self, dense: torch.Tensor, params: dict[str, int | str]) -> EncodedTensor:
        self.check(dense, params)
        m, k = dense.shape
        width = vector_width(dense.dtype)
        rows, cols = torch.nonzero(dense, as_tuple=True)
        nnz_per_row = torch.bincount(rows, minlength=m)
        padded_per_row = (nnz_per_row + width - 1) // width * width
        row_offsets = torch.zeros(m + 1, dtype=torch.int64)
        row_offsets[1:] = torch.cumsum(padded_per_row, 0)
        real_starts = torch.cumsum(nnz_per_row, 0) - nnz_per_row
        rank_in_row = torch.arange(rows.numel()) - real_starts[rows]
        slot = row_offsets[rows] + rank_in_row

        total = int(row_offsets[-1])
        values = torch.zeros(total, dtype=dense.dtype)
        values[slot] = dense[rows, cols]
        # Padding repeats the last real column of its row (every padded row has at least one).
        last_col = torch.zeros(m, dtype=torch.int64)
        last_col[rows] = cols  # nonzero() is row-major, so the last write per row is its largest column
        column_indices = last_col[csr_rows(row_offsets)]
        column_indices[slot] = cols

        index_dtype = torch.int16 if k <= INT16_MAX_COLUMNS else torch.int32
        row_indices = torch.sort(nnz_per_row, descending=True, stable=True).indices
        components = {
            "values": values,
            "row_offsets": row_offsets.to(torch.int32),
            "column_indices": column_indices.to(index_dtype),
            "row_indices": row_indices.to(torch.int32),
        }
        return EncodedTensor(self.name, (m, k), dtype_name(dense.dtype), {"vector_width": width}, components)

    def decode(self, encoded: EncodedTensor) -> torch.Tensor:
        c = encoded.components
        dense = torch.zeros(encoded.shape, dtype=encoded.torch_dtype, device=c["values"].device)
        rows = csr_rows(c["row_offsets"])
        # accumulate: padding entries are zeros on a real column, so the sum is exact.
        dense.index_put_((rows, c["column_indices"].long()), c["values"], accumulate=True)
        return dense
