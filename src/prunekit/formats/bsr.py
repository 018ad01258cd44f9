"""Block CSR (BSR): the non-zero ``r x c`` tiles of a weight, for tensor-core block-sparse matmul.

Components of a weight ``(M, K)`` with block ``(r, c)`` dividing it:

- ``blocks``: ``(nblocks, r, c)`` weight dtype, row-major over block rows, ascending block column.
- ``crow_indices``: ``(M / r + 1,)`` int32 offsets into ``blocks`` per block row.
- ``col_indices``: ``(nblocks,)`` int32 block-column index of each block.

A block is stored when any element in it is non-zero. ``params``: ``block_rows``, ``block_cols``;
the pattern's block shape when pruned with ``block:RxC``, else :data:`DEFAULT_BLOCK`.
"""

from __future__ import annotations

import torch

from .base import EncodedTensor, SparseFormat, dtype_name, register

DEFAULT_BLOCK = (16, 16)  # smallest tile of an fp16 mma.sync / wgmma fragment


def block_shape(params: dict[str, int | str]) -> tuple[int, int]:
    """``(block_rows, block_cols)`` from format params, defaulting to :data:`DEFAULT_BLOCK`."""
    return int(params.get("block_rows", DEFAULT_BLOCK[0])), int(params.get("block_cols", DEFAULT_BLOCK[1]))


@register
class BSR(SparseFormat):
    """Block CSR; see the module docstring for the component layout."""

    name = "bsr"

    def unfit_reason(self, dense: torch.Tensor, params: dict[str, int | str]) -> str | None:
        r, c = block_shape(params)
        m, k = dense.shape
        if m % r or k % c:
            return f"shape {m}x{k} is not a multiple of block {r}x{c}"
        return None

    def encode(self, dense: torch.Tensor, params: dict[str, int | str]) -> EncodedTensor:
        self.check(dense, params)
        r, c = block_shape(params)
        m, k = dense.shape
        tiles = dense.reshape(m // r, r, k // c, c).transpose(1, 2)  # (block rows, block cols, r, c)
        present = (tiles != 0).any(dim=(2, 3))
        block_row, block_col = torch.nonzero(present, as_tuple=True)
        crow = torch.zeros(m // r + 1, dtype=torch.int64)
        crow[1:] = torch.cumsum(present.sum(dim=1), 0)
        components = {
            "blocks": tiles[block_row, block_col].contiguous(),
            "crow_indices": crow.to(torch.int32),
            "col_indices": block_col.to(torch.int32),
        }
        params_out = {"block_rows": r, "block_cols": c}
        return EncodedTensor(self.name, (m, k), dtype_name(dense.dtype), params_out, components)

    def decode(self, encoded: EncodedTensor) -> torch.Tensor:
        r, c = block_shape(encoded.params)
        m, k = encoded.shape
        comp = encoded.components
        tiles = torch.zeros(m // r, k // c, r, c, dtype=encoded.torch_dtype, device=comp["blocks"].device)
        counts = (comp["crow_indices"][1:] - comp["crow_indices"][:-1]).long()
        block_row = torch.repeat_interleave(torch.arange(m // r, device=counts.device), counts)
        tiles[block_row, comp["col_indices"].long()] = comp["blocks"]
        return tiles.transpose(1, 2).reshape(m, k)
