"""Bitmask format, compatible with compressed-tensors' ``sparse-bitmask`` layout.

Components of a weight ``(M, K)``:

- ``compressed``: ``(nnz,)`` weight dtype, the non-zeros in row-major order.
- ``bitmask``: ``(M, ceil(K / 8))`` uint8, bit ``j % 8`` (little-end first) of byte ``j // 8`` set
  when column ``j`` is non-zero.
- ``row_offsets``: ``(M,)`` int64, index into ``compressed`` where each row starts.
- ``shape``: ``(2,)`` int64, the dense shape.

A storage format: compact at moderate sparsity (1 bit per element of overhead), computed by
decoding to dense.
"""

from __future__ import annotations

import torch

from .base import EncodedTensor, SparseFormat, dtype_name, register
from .nm import pack_indices, unpack_indices


@register
class Bitmask(SparseFormat):
    """compressed-tensors ``sparse-bitmask``; see the module docstring."""

    name = "bitmask"

    def encode(self, dense: torch.Tensor, params: dict[str, int | str]) -> EncodedTensor:
        self.check(dense, params)
        m, k = dense.shape
        mask = dense != 0
        nnz_per_row = mask.sum(dim=1)
        components = {
            "compressed": dense[mask].contiguous(),
            "bitmask": pack_indices(mask.to(torch.int32), 1),
            "row_offsets": torch.cumsum(nnz_per_row, 0) - nnz_per_row,
            "shape": torch.tensor([m, k], dtype=torch.int64),
        }
        return EncodedTensor(self.name, (m, k), dtype_name(dense.dtype), {}, components)

    def decode(self, encoded: EncodedTensor) -> torch.Tensor:
        m, k = encoded.shape
        comp = encoded.components
        mask = unpack_indices(comp["bitmask"], 1, k).bool()
        dense = torch.zeros(m, k, dtype=encoded.torch_dtype, device=comp["compressed"].device)
        dense[mask] = comp["compressed"]
        return dense
