"""Block CSR (BSR): the non-zero ``r x c`` tiles of a weight, for tensor-core block-sparse matmul.

Components of a weight ``(M, K)`` with block ``(r, c)`` dividing it:

- ``blocks``: ``(nblocks, r, c)`` weight dtype, row-major over block rows, ascending block column.
- ``crow_indices``: ``(M / r + 1,)`` int32 offsets into ``blocks`` per block row.
- ``col_indices``: ``(nblocks,)`` int32 block-column index of each block.
- ``schedule``: ``(n_items, 4)`` int32 static work schedule for the GPU kernel (PopSparse's static mode, Li et al.
  2023: the pattern is known at export, so the load balancing is computed once, here): one item ``(block_row,
  start, end, slot)`` per CTA row, covering blocks ``start:end`` of ``block_row``; block rows with more than
  :func:`schedule_chunk` blocks are split evenly over several items (``slot`` >= 0 indexes ``split_rows``, else -1);
  items are ordered by descending block count so the hardware dispatches the longest first (LPT order).
- ``split_rows``: ``(n_split,)`` int32 block rows that the schedule splits (their partial sums are reduced in fp32).

A block is stored when any element in it is non-zero. ``params``: ``block_rows``, ``block_cols``;
the pattern's block shape when pruned with ``block:RxC``, else :data:`DEFAULT_BLOCK`.
"""

from __future__ import annotations

import math

import torch

from .base import EncodedTensor, SparseFormat, dtype_name, register

DEFAULT_BLOCK = (16, 16)  # smallest tile of an fp16 mma.sync / wgmma fragment
SCHEDULE_MIN_CHUNK = 8  # never split a block row into slices of fewer blocks: the fp32 reduction would cost more
SCHEDULE_CHUNK_OVER_MEDIAN = 2.0  # split block rows longer than twice the median non-empty row (imbalance > 2x)


def block_shape(params: dict[str, int | str]) -> tuple[int, int]:
    """``(block_rows, block_cols)`` from format params, defaulting to :data:`DEFAULT_BLOCK`."""
    return int(params.get("block_rows", DEFAULT_BLOCK[0])), int(params.get("block_cols", DEFAULT_BLOCK[1]))


def schedule_chunk(counts: torch.Tensor) -> int:
    """Most blocks one schedule item covers, for per-block-row block ``counts: (M / r,)``.

    ``max(SCHEDULE_MIN_CHUNK, ceil(SCHEDULE_CHUNK_OVER_MEDIAN * median count of the non-empty rows))`` (the median,
    so that a few heavy rows do not raise the bar): uniform patterns are not split at all; a row over twice the
    median is cut into even slices so that no CTA runs much longer than the rest.
    """
    nonempty = counts[counts > 0]
    if nonempty.numel() == 0:
        return SCHEDULE_MIN_CHUNK
    median = float(nonempty.double().median())
    return max(SCHEDULE_MIN_CHUNK, math.ceil(SCHEDULE_CHUNK_OVER_MEDIAN * median))


SCHEDULE_ORDERS = ("length", "row", "mix")


def static_schedule(
    crow_indices: torch.Tensor, chunk: int | None = None, order: str = "length"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Static load-balanced schedule of a BSR pattern (PopSparse static mode, Li et al. 2023).

    Args:
        crow_indices: ``(M / r + 1,)`` int32/int64 block-row offsets.
        chunk: most blocks per item; default :func:`schedule_chunk`.
        order: the items' order, which is the kernels' launch order (one CTA per item and N tile, items fastest):
            ``"length"`` by descending ``end - start`` (stable; longest first), ``"row"`` by block row (the dynamic
            mode's order, with a split row's items side by side), ``"mix"`` the ``"length"`` order taken from both
            ends in turn (longest, shortest, second longest, ...).

    Returns:
        ``schedule: (n_items, 4)`` int32 rows ``(block_row, start, end, slot)`` (every block row appears, empty ones
        as one item with ``start == end`` so the kernel writes their bias/activation), in ``order``, and
        ``split_rows: (n_split,)`` int32, the block rows cut into several items, in slot order. Every block index
        lies in exactly one item.

    Raises:
        ValueError: an unknown ``order``.
    """
    if order not in SCHEDULE_ORDERS:
        raise ValueError(f"schedule order must be one of {SCHEDULE_ORDERS}, got {order!r}")
    crow = crow_indices.to(torch.int64).cpu()
    counts = crow[1:] - crow[:-1]
    rows = counts.numel()
    if chunk is None:
        chunk = schedule_chunk(counts)
    pieces = torch.clamp((counts + chunk - 1) // chunk, min=1)
    item_row = torch.repeat_interleave(torch.arange(rows), pieces)
    first_item = torch.cumsum(pieces, 0) - pieces
    piece = torch.arange(item_row.numel()) - first_item[item_row]
    row_pieces = pieces[item_row]
    row_count = counts[item_row]
    start = crow[item_row] + row_count * piece // row_pieces
    end = crow[item_row] + row_count * (piece + 1) // row_pieces
    split = pieces > 1
    slot_of_row = torch.where(split, torch.cumsum(split.to(torch.int64), 0) - 1, torch.full_like(counts, -1))
    items = torch.stack([item_row, start, end, slot_of_row[item_row]], dim=1)
    if order == "row":
        perm = torch.arange(items.shape[0])  # item_row is non-decreasing already
    else:
        perm = torch.argsort(-(end - start), stable=True)
        if order == "mix":
            n_items = perm.numel()
            i = torch.arange(n_items)
            perm = perm[torch.where(i % 2 == 0, i // 2, n_items - 1 - i // 2)]
    split_rows = torch.nonzero(split, as_tuple=True)[0]
    return items[perm].to(torch.int32).contiguous(), split_rows.to(torch.int32)


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
        schedule, split_rows = static_schedule(crow)
        components = {
            "blocks": tiles[block_row, block_col].contiguous(),
            "crow_indices": crow.to(torch.int32),
            "col_indices": block_col.to(torch.int32),
            "schedule": schedule,
            "split_rows": split_rows,
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
