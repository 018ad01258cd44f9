"""Condensed-window plan for the tensor-core SpMM (``spmm_tc.cu``): "load sparse, compute dense".

The sparse weight ``A (M, K)`` is cut into windows of :data:`WINDOW_ROWS` = 16 rows (the ``m = 16`` A operand of
``mma.sync.m16n8k16``) and K into chunks of :data:`K_CHUNK` = 256 columns (the rows of X one thread block stages in
shared memory at a time). For each (window, chunk) *segment* the plan keeps only the union of the columns that any row
of the window uses, in an order that keeps the kernel's ``ldmatrix`` gathers free of bank conflicts, padded with zero
entries to a multiple of :data:`K_STEP` = 16 (one mma k-step). Per k-step it stores

- the 16 x 16 condensed weight tile in ``mma.m16n8k16`` A-fragment order (``frag_values (ksteps, 32, 8)``: lane
  ``l`` loads its 8 elements with one 16-byte load), and
- the 16 chunk-local X rows (``slot_rows (ksteps, 16)`` uint8) that lane ``l & 15`` passes to ``ldmatrix.trans`` as
  its row address, which gathers the matching X rows out of the staged chunk at no extra cost.

Condensing rows of a window onto their column union is the tensor-core SpMM idea of e.g. TC-GNN (Wang et al., USENIX
ATC 2023) and the "window / condensed tile" kernels of Magicube and VectorSparse; issue 4 of this repository gives the
density arithmetic (a window of R rows keeps ``1 - (1 - density)^R`` of the columns for random patterns).

Slot order (bank conflicts): the kernel's X chunk is swizzled so that 16-byte column group ``c`` of chunk row ``r``
sits at group ``c ^ (r % 8)``; one 8 x 8 matrix of an ``ldmatrix`` reads 8 gathered rows at one column group, which is
conflict-free exactly when the 8 rows have distinct ``r % 8``. A segment of ``T`` k-steps has ``G = 2 T`` such groups
of 8 slots. The ``g``-th union column (rank ``g``) of residue ``r`` takes slot ``8 g + r`` while ``g < G``, so no group
holds a residue twice. A residue with more than ``G`` columns puts its excess into the other groups' empty positions,
spread one per group where possible (position-major order), and only those conflict: by pigeonhole, no order without
more k-steps does better. The empty positions left over are padding (weight 0), and each reads chunk row ``p`` for
its position ``p``, a residue its group lacks. An earlier order packed the ranks back to back ("rank-major"), which
also repeated residues at every group boundary once one residue ran out (H100 plans at 90% / 95% / 98%: 1.18 /
1.32 / 1.57 wavefronts per matrix; :attr:`TcPlan.conflict_factor` measures it).

Optional row reordering (``row_order``): the window slots take the rows in the given order and the kernel writes each
output row back to its real position (``window_rows``), so a permutation that puts rows with similar column sets in
one window shrinks the unions at no runtime cost. :func:`spectral_row_order` finds such a permutation by recursive
spectral bisection of the rows' column sets (each split by the sign of the centred pattern's leading singular
vector, as in spectral partitioning, Pothen, Simon & Liou 1990, applied to rows as in row-reordering SpMM work such as
Jiang, Hong & Agrawal, PPoPP 2020), and :func:`get_tc_plan` keeps the reordered plan when it has fewer k-steps.

Everything here is vectorised torch (no Python loop over rows or segments) and runs on the weight's device.
:func:`tc_plan_matmul` multiplies with exactly the plan's data (fragment order, slot rows, padding, row order): the CPU
tests check it against float64 so the index math is verified without a GPU. torch only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..formats.csr import csr_rows
from .tensor_cache import cached

WINDOW_ROWS = 16  # mma.sync.m16n8k16: the weight window is the A operand, m = 16 rows
K_STEP = 16  # mma.sync.m16n8k16: k = 16 per instruction
K_CHUNK = 256  # X rows per shared-memory stage; chunk-local rows fit uint8 (docs/KERNELS.md: padding vs chunk size)
LDMATRIX_ROWS = 8  # one 8x8 matrix of ldmatrix reads 8 row addresses
LANES = 32
FRAG_ELEMS = 8  # A-fragment elements per lane (4 x 32-bit registers of 2 halves)
_WINDOW_SHIFT = WINDOW_ROWS.bit_length() - 1
_CHUNK_SHIFT = K_CHUNK.bit_length() - 1
_KSTEP_SHIFT = K_STEP.bit_length() - 1

REORDER_MAX_ELEMENTS = 1 << 27  # M * K above this: no reordering (the dense float32 pattern would be > 512 MiB)
REORDER_ENV = "PRUNEKIT_TC_REORDER"  # "0" turns the row reordering of get_tc_plan off

__all__ = [
    "K_CHUNK",
    "K_STEP",
    "WINDOW_ROWS",
    "TcPlan",
    "build_tc_plan",
    "fragment_index",
    "get_tc_plan",
    "spectral_row_order",
    "greedy_window_order",
    "tc_plan_matmul",
]


@dataclass(frozen=True)
class TcPlan:
    """Condensed-window plan of one sparse weight for ``spmm_tc.cu`` (see the module docstring).

    Attributes:
        m, k: weight shape ``(M, K)``.
        num_windows: ``ceil(M / 16)``; num_chunks: ``ceil(K / 256)``.
        frag_values: ``(ksteps, 32, 8)`` weight dtype, A fragments (padding entries 0).
        slot_rows: ``(ksteps, 16)`` uint8, chunk-local X row of each k slot.
        kstep_offsets: ``(num_windows * num_chunks + 1,)`` int32, k-steps of segment ``w * num_chunks + c``.
        window_rows: ``(num_windows * 16,)`` int32, output row of each window slot, -1 for none.
    """

    m: int
    k: int
    num_windows: int
    num_chunks: int
    frag_values: torch.Tensor
    slot_rows: torch.Tensor
    kstep_offsets: torch.Tensor
    window_rows: torch.Tensor

    @property
    def ksteps(self) -> int:
        """Total mma k-steps (each 16 x 16 weight entries) over all segments."""
        return self.frag_values.shape[0]

    @property
    def compute_fraction(self) -> float:
        """mma work relative to a dense GEMM over the same windows: ``16 * ksteps / (num_windows * K)``."""
        return K_STEP * self.ksteps / max(1, self.num_windows * self.k)

    @property
    def conflict_factor(self) -> float:
        """Mean shared-memory wavefronts per 8x8 ``ldmatrix`` matrix (1.0 = conflict-free; 8 rows at most)."""
        if self.ksteps == 0:
            return 1.0
        groups = (self.slot_rows.long() % LDMATRIX_ROWS).view(-1, LDMATRIX_ROWS)
        counts = torch.zeros(groups.shape[0], LDMATRIX_ROWS, dtype=torch.int64, device=groups.device)
        counts.scatter_add_(1, groups, torch.ones_like(groups))
        return float(counts.max(1).values.double().mean())

    @property
    def nbytes(self) -> int:
        """Device bytes held by the plan's tensors."""
        return sum(
            t.numel() * t.element_size()
            for t in (self.frag_values, self.slot_rows, self.kstep_offsets, self.window_rows)
        )


def fragment_index(row: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lane, element) holding A-tile entry ``(row, slot)`` in the ``mma.m16n8k16`` A fragment (PTX ISA 9.7.13.4.8).

    ``row, slot`` in ``[0, 16)``; lane ``= (row % 8) * 4 + (slot % 8) // 2``, element ``= slot % 2 + 2 * (row // 8) +
    4 * (slot // 8)`` (registers a0..a7 of the PTX figure).
    """
    lane = (row % 8) * 4 + (slot % 8) // 2
    elem = slot % 2 + 2 * (row // 8) + 4 * (slot // 8)
    return lane, elem


def _padding_mask(row_offsets: torch.Tensor, cols: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    pad = torch.zeros(cols.numel(), dtype=torch.bool, device=cols.device)
    if cols.numel() > 1:
        pad[1:] = (cols[1:] == cols[:-1]) & (rows[1:] == rows[:-1])
    return pad


def build_tc_plan(
    values: torch.Tensor,
    row_offsets: torch.Tensor,
    column_indices: torch.Tensor,
    m: int,
    k: int,
    row_order: torch.Tensor | None = None,
) -> TcPlan:
    """Build the condensed-window plan of a prunekit CSR weight (``formats/csr.py`` layout) for ``spmm_tc.cu``.

    Args:
        values: ``(nnz_padded,)`` fp16/bf16 (any float dtype for the CPU emulation); row_offsets: ``(M + 1,)`` int32;
            column_indices: ``(nnz_padded,)`` int16/int32, ascending within a row, padding repeating the last column;
            m, k: the weight shape; row_order: optional ``(M,)`` permutation of the rows, window slot ``p`` takes row
            ``row_order[p]`` (default: identity).

    Returns:
        A :class:`TcPlan` on ``values``' device.

    Raises:
        ValueError: inconsistent shapes, or ``row_order`` not a permutation of ``range(M)``.
    """
    device = values.device
    if row_offsets.numel() != m + 1 or column_indices.numel() != values.numel():
        raise ValueError(
            f"CSR of a ({m}, {k}) weight expected: row_offsets has {row_offsets.numel()} entries (M + 1 = {m + 1}), "
            f"column_indices {column_indices.numel()} and values {values.numel()}"
        )
    num_windows = -(-m // WINDOW_ROWS)
    num_chunks = max(1, -(-k // K_CHUNK))
    num_segments = num_windows * num_chunks
    rows = csr_rows(row_offsets.to(device))
    cols = column_indices.to(device).long()
    keep = ~_padding_mask(row_offsets, cols, rows) & (values != 0)
    rows, cols, vals = rows[keep], cols[keep], values[keep]
    if rows.numel() and (int(cols.min()) < 0 or int(cols.max()) >= k):
        raise ValueError(f"column_indices out of range for K = {k}")

    window_rows = torch.full((num_windows * WINDOW_ROWS,), -1, dtype=torch.int64, device=device)
    if row_order is None:
        window_rows[:m] = torch.arange(m, device=device)
        pos_of_row = torch.arange(m, device=device)
    else:
        order = row_order.to(device).long()
        if order.shape != (m,) or not torch.equal(torch.sort(order).values, torch.arange(m, device=device)):
            raise ValueError(f"row_order must be a permutation of range({m})")
        window_rows[:m] = order
        pos_of_row = torch.empty(m, dtype=torch.int64, device=device)
        pos_of_row[order] = torch.arange(m, device=device)

    # int32 and shifts (the window, chunk and k-step sizes are powers of two): this loop-free pass is bound by
    # elementwise passes over the non-zeros. The key below reaches num_segments * 256: int64 where that passes int32.
    idx = torch.int32 if num_segments * K_CHUNK < 2**31 else torch.int64
    slot_pos = (rows if row_order is None else pos_of_row[rows]).to(idx)  # window slot of every entry
    cols32 = cols.to(idx)
    window_row = slot_pos & (WINDOW_ROWS - 1)
    # (segment, chunk-local column) of every entry; segment = window * num_chunks + chunk.
    key = (((slot_pos >> _WINDOW_SHIFT) * num_chunks + (cols32 >> _CHUNK_SHIFT)) << _CHUNK_SHIFT) | (
        cols32 & (K_CHUNK - 1)
    )
    key = key.long()
    del slot_pos, rows, cols32

    # Union of columns per segment: a dense (segments, 32 ranks, 8 residues) occupancy grid; no sort over entries.
    present = torch.zeros(num_segments * K_CHUNK, dtype=torch.bool, device=device)
    present[key] = True
    grid = present.view(num_segments, K_CHUNK // LDMATRIX_ROWS, LDMATRIX_ROWS)
    counts = grid.sum(1)  # (segments, 8): union columns per residue
    rank = torch.cumsum(grid, 1, dtype=torch.int32) - 1  # rank of each union column within its residue
    union = counts.sum(1)
    ksteps_per_segment = (union + K_STEP - 1) // K_STEP
    kstep_offsets = torch.zeros(num_segments + 1, dtype=torch.int64, device=device)
    kstep_offsets[1:] = torch.cumsum(ksteps_per_segment, 0)
    total_ksteps = int(kstep_offsets[-1])

    # Slot of every union column within its segment (see the module docstring, "Slot order"): the column of rank g and
    # residue r sits at slot 8 g + r while g < G (the segment's 8-slot groups), so each group holds each residue at
    # most once; the excess ranks (g >= G, a residue with more than G columns) fill the groups' empty positions,
    # position-major so that they spread over groups, and the positions left over are padding.
    groups = 2 * ksteps_per_segment  # (segments,)
    g_idx = torch.arange(K_CHUNK // LDMATRIX_ROWS, device=device)
    excess = grid & (rank.long() >= groups[:, None, None])  # (segments, 32 chunk rows / 8, 8 residues)
    empty = (g_idx[None, :, None] < groups[:, None, None]) & (counts[:, None, :] <= g_idx[None, :, None])
    empty_pm = empty.transpose(1, 2).reshape(num_segments, K_CHUNK)  # position-major: (residue position p, group g)
    empty_rank = torch.cumsum(empty_pm, 1) - 1
    slot_of_empty = torch.full((num_segments, K_CHUNK), -1, dtype=torch.int64, device=device)
    pg = torch.nonzero(empty_pm)
    p_pos, g_pos = pg[:, 1] // (K_CHUNK // LDMATRIX_ROWS), pg[:, 1] % (K_CHUNK // LDMATRIX_ROWS)
    slot_of_empty[pg[:, 0], empty_rank[pg[:, 0], pg[:, 1]]] = g_pos * LDMATRIX_ROWS + p_pos
    excess_rank = (torch.cumsum(excess.view(num_segments, K_CHUNK), 1) - 1).view(-1)
    del empty, empty_pm, empty_rank, pg, p_pos, g_pos

    union_key = torch.nonzero(present).squeeze(1)
    seg = union_key // K_CHUNK
    local = union_key % K_CHUNK
    residue = local % LDMATRIX_ROWS
    rank_u = rank.view(-1)[union_key].long()
    in_seg = rank_u * LDMATRIX_ROWS + residue
    is_excess = excess.view(-1)[union_key]
    in_seg[is_excess] = slot_of_empty[seg[is_excess], excess_rank[union_key[is_excess]]]
    slot_global = kstep_offsets[seg] * K_STEP + in_seg
    # Padding slots read chunk row (slot % 8): their group has no other column of that residue; the weight there is 0.
    slot_rows = (torch.arange(total_ksteps * K_STEP, device=device) % LDMATRIX_ROWS).to(torch.uint8)
    slot_rows[slot_global] = local.to(torch.uint8)
    slot_of_key = torch.empty(num_segments * K_CHUNK, dtype=torch.int64, device=device)
    slot_of_key[union_key] = slot_global
    del union_key, seg, local, residue, rank_u, in_seg, is_excess, present, grid, rank, excess, slot_of_empty

    entry_slot = slot_of_key[key]
    del slot_of_key, key
    kstep = entry_slot >> _KSTEP_SHIFT
    lane, elem = fragment_index(window_row.long(), entry_slot & (K_STEP - 1))
    frag = torch.zeros(total_ksteps * LANES * FRAG_ELEMS, dtype=values.dtype, device=device)
    frag[(kstep * LANES + lane) * FRAG_ELEMS + elem] = vals
    return TcPlan(
        m=m,
        k=k,
        num_windows=num_windows,
        num_chunks=num_chunks,
        frag_values=frag.view(total_ksteps, LANES, FRAG_ELEMS),
        slot_rows=slot_rows.view(total_ksteps, K_STEP),
        kstep_offsets=kstep_offsets.to(torch.int32),
        window_rows=window_rows.to(torch.int32),
    )


_CACHE_ATTR = "_prunekit_tc_plan"  # on the stored values tensor (tensor_cache.cached)


def _dense_pattern(row_offsets: torch.Tensor, column_indices: torch.Tensor, m: int, k: int, who: str) -> torch.Tensor:
    """The binary pattern ``(M, K)`` float32 of a prunekit CSR on ``column_indices``' device (padding repeats a column
    of its row, so it changes nothing). Raises ValueError above :data:`REORDER_MAX_ELEMENTS`."""
    if m * k > REORDER_MAX_ELEMENTS:
        raise ValueError(f"{who}: M * K = {m * k} is above {REORDER_MAX_ELEMENTS} elements")
    device = column_indices.device
    pattern = torch.zeros(m, k, dtype=torch.float32, device=device)
    pattern[csr_rows(row_offsets.to(device).long()), column_indices.long()] = 1.0
    return pattern


def spectral_row_order(
    row_offsets: torch.Tensor,
    column_indices: torch.Tensor,
    m: int,
    k: int,
    group: int = WINDOW_ROWS,
    iters: int = 10,
    seed: int = 0,
) -> torch.Tensor:
    """A row permutation that puts rows with similar column sets into the same window of ``group`` rows.

    Recursive spectral bisection of the binary pattern ``P (M, K)``: a set of rows is split at the median of its
    projection on the leading right singular vector of ``P[rows] - mean(P[rows])`` (``iters`` power iterations from
    a seeded random start), the first part rounded up to a multiple of ``group``, until a part has at most ``group``
    rows; the leaves in order form the permutation, so every window but the last holds rows of one leaf. Cost: about
    ``2 * iters * M * K`` FLOP per level, ``log2(M / group)`` levels, on the pattern's device; memory about ``8 * M * K``
    bytes (a dense float32 pattern and the copy of the part being split).

    Args:
        row_offsets: ``(M + 1,)`` int32/int64; column_indices: ``(nnz_padded,)`` int16/int32/int64 (prunekit CSR: a
            row's padding repeats a column of the row, which does not change its column set).
        m, k: the weight shape; group: rows per window.

    Returns:
        ``(M,)`` int64 permutation on the pattern's device: window slot ``p`` takes row ``order[p]``.

    Raises:
        ValueError: ``M * K`` above :data:`REORDER_MAX_ELEMENTS`.
    """
    pattern = _dense_pattern(row_offsets, column_indices, m, k, "spectral_row_order")
    device = pattern.device
    gen = torch.Generator(device=device).manual_seed(seed)
    leaves: list[torch.Tensor] = []
    stack = [torch.arange(m, device=device)]
    while stack:
        part = stack.pop()
        if part.numel() <= group:
            leaves.append(part)
            continue
        sub = pattern[part]
        mean = sub.mean(0)  # (P - 1 mean^T) v = P v - (mean . v); (P - 1 mean^T)^T u = P^T u - mean * sum(u)
        v = torch.randn(k, generator=gen, device=device)
        for _ in range(iters):
            u = sub @ v - mean @ v
            v = sub.t() @ u - mean * u.sum()
            v = v / v.norm().clamp_min(1e-30)
        by_score = torch.argsort(sub @ v - mean @ v, stable=True)
        first = -(-(part.numel() // 2) // group) * group
        stack.append(part[by_score[first:]])
        stack.append(part[by_score[:first]])
    return torch.cat(leaves) if leaves else torch.zeros(0, dtype=torch.int64, device=device)


def greedy_window_order(
    row_offsets: torch.Tensor,
    column_indices: torch.Tensor,
    m: int,
    k: int,
    start_order: torch.Tensor,
    group: int = WINDOW_ROWS,
    block: int = 512,
) -> torch.Tensor:
    """Refine a row permutation window by window, in blocks of ``block`` consecutive rows of ``start_order`` (``block /
    group`` windows each, all blocks at once): each window starts with the block's first row not yet placed, then
    takes ``group - 1`` times the row of its block that adds the fewest columns to the window's union (ties: the
    earliest). A greedy row clustering in the spirit of the row-reordering SpMM work cited in the module docstring.
    Given the order of :func:`spectral_row_order`, it cut the k-steps of the magnitude-pruned all-MiniLM-L6-v2 layers a
    further 3-4% (``benchmarks/tc_plan_stats.py``; docs/KERNELS.md).

    Cost: ``block - 1`` sequential steps, each a batched product of the ``(M, K)`` pattern with one union per block
    (``2 * M * K`` FLOP); memory: the dense float32 pattern (``4 * M * K`` bytes).

    Args:
        row_offsets, column_indices: prunekit CSR (as for :func:`spectral_row_order`); m, k: the weight shape;
        start_order: ``(M,)`` permutation to refine; group: rows per window; block: rows per block, a multiple of
            ``group`` (windows never straddle blocks, so they stay aligned with the plan's windows).

    Returns:
        ``(M,)`` int64 permutation on the pattern's device.

    Raises:
        ValueError: ``M * K`` above :data:`REORDER_MAX_ELEMENTS`, or ``block`` not a multiple of ``group``.
    """
    if block % group:
        raise ValueError(f"greedy_window_order: block = {block} is not a multiple of group = {group}")
    pattern = _dense_pattern(row_offsets, column_indices, m, k, "greedy_window_order")
    device = pattern.device
    start_order = start_order.to(device).long()
    blocks = -(-m // block)
    rows = torch.zeros(blocks * block, k, dtype=torch.float32, device=device)
    rows[:m] = pattern[start_order]
    del pattern
    rows = rows.view(blocks, block, k)
    nnz = rows.sum(2)  # (blocks, block)
    placed = torch.zeros(blocks, block, dtype=torch.bool, device=device)
    placed.view(-1)[m:] = True  # the last block's padding rows are never chosen
    position = torch.arange(block, device=device)
    slots = torch.empty(blocks, block, dtype=torch.int64, device=device)  # slots[b, i]: block row placed i-th
    batch = torch.arange(blocks, device=device)
    inf = torch.tensor(float("inf"), device=device)
    union = overlap = None
    for step in range(block):
        if step % group == 0:  # a new window: its seed is the block's first unplaced row
            pick = torch.argmin(placed.long() * block + position, dim=1)
            union = rows[batch, pick].clone()
        else:
            pick = torch.argmin(torch.where(placed, inf, nnz - overlap) * block + position, dim=1)
        fresh = ~placed[batch, pick]  # False once a block has no unplaced row left (the last block's tail)
        slots[:, step] = torch.where(fresh, pick, blocks * block)  # a sentinel past every real row
        placed[batch, pick] = True
        added = rows[batch, pick] * (1 - union) if step % group else union
        if step % group:
            union += added
            overlap += torch.bmm(rows, added.unsqueeze(2)).squeeze(2)
        else:
            overlap = torch.bmm(rows, union.unsqueeze(2)).squeeze(2)
    order = (slots + batch[:, None] * block).view(-1)  # padding rows sit at positions >= m, sentinels beyond
    return start_order[order[order < m]]


def _reorder_default() -> bool:
    return os.environ.get(REORDER_ENV, "1") != "0"


def get_tc_plan(
    values: torch.Tensor,
    row_offsets: torch.Tensor,
    column_indices: torch.Tensor,
    m: int,
    k: int,
    reorder: bool | None = None,
) -> TcPlan:
    """:func:`build_tc_plan` cached on ``values`` (rebuilt when values, indices or shape change in place or by identity).

    With ``reorder`` (default: on unless ``$PRUNEKIT_TC_REORDER`` is ``0``) and ``M * K <=``
    :data:`REORDER_MAX_ELEMENTS`, the plan is also built on the rows permuted by :func:`spectral_row_order` and by its
    refinement :func:`greedy_window_order`, and the plan with the fewest k-steps is kept (the earlier on a tie): the kernel's work is proportional to its k-steps,
    and the permuted plan writes every row to its own place, so the product is the same.

    The key holds the data pointers and version counters of ``values``, ``column_indices`` and ``row_offsets``, the
    shape, the dtype and ``reorder``, like the cuSPARSELt weight cache in ``structured.py``; the plan lives as long as
    the stored values tensor. The cache entry also holds the storages of the three tensors, so memory the key points
    to cannot be freed and handed to other data at the same address while the entry lives (e.g. after
    ``values.data = ...`` or new index tensors; a data-pointer key alone would then return a stale plan). Inference
    tensors (made under ``torch.inference_mode``) keep no version counter: for them only identity (data pointers,
    shape) is checked, so an in-place edit of such a weight is not detected.
    """
    reorder = _reorder_default() if reorder is None else reorder

    def build() -> TcPlan:
        plan = build_tc_plan(values, row_offsets, column_indices, m, k)
        if reorder and m > WINDOW_ROWS and 0 < m * k <= REORDER_MAX_ELEMENTS:
            spectral = spectral_row_order(row_offsets, column_indices, m, k)
            for order in (spectral, greedy_window_order(row_offsets, column_indices, m, k, spectral)):
                reordered = build_tc_plan(values, row_offsets, column_indices, m, k, order)
                if reordered.ksteps < plan.ksteps:
                    plan = reordered
        return plan

    extra = (m, k, values.dtype, values.device, reorder)
    return cached(values, _CACHE_ATTR, (values, column_indices, row_offsets), extra, build)


def tc_plan_matmul(
    plan: TcPlan,
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """CPU emulation of ``spmm_tc.cu``: ``Y (M, N) = act(A @ X + bias)`` computed from the plan's data only.

    Decodes each k-step's A tile from fragment order, gathers the X rows named by ``slot_rows`` out of the zero-padded
    chunk (rows past K are 0, as the kernel's staging makes them), multiplies per k-step, sums per window and writes
    window slot ``p`` to output row ``window_rows[p]``. Computed in ``dtype`` (float64 by default).

    Args:
        plan: from :func:`build_tc_plan`; x: ``(K, N)`` any strides; bias: ``(M,)`` or None; activation: none|relu.

    Returns:
        ``(M, N)`` in ``dtype``.
    """
    if activation not in ("none", "relu"):
        raise ValueError(f"unknown activation {activation!r}; known: none, relu")
    device = plan.frag_values.device
    n = x.shape[1]
    slots = torch.arange(K_STEP, device=device)
    lane, elem = fragment_index(slots[:, None], slots[None, :])  # (16 rows, 16 slots)
    a = plan.frag_values.to(dtype)[:, lane, elem]  # (ksteps, 16, 16)
    counts = (plan.kstep_offsets[1:] - plan.kstep_offsets[:-1]).long()
    seg_of_kstep = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts)
    window_of_kstep = seg_of_kstep // plan.num_chunks
    chunk_of_kstep = seg_of_kstep % plan.num_chunks
    xpad = torch.zeros(plan.num_chunks * K_CHUNK, n, dtype=dtype, device=device)
    xpad[: plan.k] = x.to(device=device, dtype=dtype)
    gathered = xpad[chunk_of_kstep[:, None] * K_CHUNK + plan.slot_rows.long()]  # (ksteps, 16, N)
    windows = torch.zeros(plan.num_windows, WINDOW_ROWS, n, dtype=dtype, device=device)
    windows.index_add_(0, window_of_kstep, torch.bmm(a, gathered))
    y = torch.zeros(plan.m, n, dtype=dtype, device=device)
    valid = plan.window_rows >= 0
    y[plan.window_rows[valid].long()] = windows.view(-1, n)[valid]
    if bias is not None:
        y = y + bias.to(device=device, dtype=dtype)[:, None]
    return torch.relu(y) if activation == "relu" else y


# ------------------------------------------------------------------------------------------------ kernel replay
# PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type" (f16 / bf16), written here as maps from
# (lane, fragment element) to the tile's (row, col), independently of fragment_index (its inverse, which the plan
# uses to encode): groupID = lane >> 2, threadID_in_group = lane % 4.
KERNEL_WARPS = 8  # warps per block of spmm_tc.cu (kTcWarps)


def _mma_a_coords(lane: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A (16 x 16, row): a_i of ``lane`` is at row groupID (+ 8 for i in {2, 3, 6, 7}), col 2 * tig + (i & 1)
    (+ 8 for i >= 4)."""
    row = (lane >> 2) + 8 * ((i >> 1) & 1)
    col = 2 * (lane & 3) + (i & 1) + 8 * (i >> 2)
    return row, col


def _mma_b_coords(lane: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """B (16 x 8, k x n, col): b_i of ``lane`` is at k = 2 * tig + (i & 1) (+ 8 for i >= 2), n = groupID."""
    return 2 * (lane & 3) + (i & 1) + 8 * (i >> 1), (lane >> 2) + 0 * i


def _mma_c_coords(lane: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """C / D (16 x 8, fp32): c_i of ``lane`` is at row groupID (+ 8 for i >= 2), col 2 * tig + (i & 1)."""
    return (lane >> 2) + 8 * (i >> 1), 2 * (lane & 3) + (i & 1)


@dataclass(frozen=True)
class TcKernelReplay:
    """Result of :func:`replay_tc_kernel`.

    Attributes:
        y: ``(M, N)`` output in the replay's dtype; elements no epilogue store reached stay NaN.
        writes: ``(M, N)`` int64, number of epilogue stores to each element (1 everywhere for a correct kernel).
        wavefronts: mean shared-memory wavefronts per 8x8 ``ldmatrix`` matrix, counted from the replayed row
            addresses (16-byte groups in the same 128-byte bank line conflict unless equal).
    """

    y: torch.Tensor
    writes: torch.Tensor
    wavefronts: float


def replay_tc_kernel(
    plan: TcPlan,
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    windows_per_warp: int = 1,
    ntile: int = 64,
    dtype: torch.dtype = torch.float64,
) -> TcKernelReplay:
    """Replay ``spmm_tc.cu`` lane by lane on the CPU: its staging, gathers, register fragments and epilogue.

    Unlike :func:`tc_plan_matmul` (which decodes the plan with :func:`fragment_index`, the same map that encoded it),
    this follows the kernel's own index expressions: ``stage_chunk`` writes 16-byte group ``c`` of chunk row ``r`` to
    group ``r * CPR + (c ^ (r & 7))`` of a NaN-poisoned shared buffer (zero outside X); in ``segment_mma`` lane ``l``
    passes chunk row ``slot_rows[t, l & 15]`` at column group ``2 * j2 + (l >> 4)`` to ``ldmatrix.x4.trans``, whose
    result registers follow the PTX ``ldmatrix`` definition (register ``i`` of lane ``l``: elements ``2 * (l % 4)``
    and ``+1`` of rows of matrix ``i``, column ``l / 4``); registers 0-1 and 2-3 feed the mma of n8 tiles ``2 * j2``
    and ``2 * j2 + 1``; the A registers are the lane's 16 bytes of ``frag_values``; A, B and C/D fragments are
    placed by the PTX ISA's m16n8k16 tables (``_mma_*_coords``, written as lane -> (row, col), independent of
    :func:`fragment_index`); blocks, warps and windows per warp are enumerated as the grid does, and the epilogue
    stores (bias, ReLU, ``window_rows``, M and N residues) are counted. A fragment-layout, swizzle or epilogue bug in
    the kernel that is mirrored here shows up as a mismatch with the float64 reference, a NaN, or a write count
    other than 1.

    Args:
        plan: from :func:`build_tc_plan`; x: ``(K, N)`` with ``K == plan.k`` (any strides, any float dtype);
            bias: ``(M,)`` or None; activation: none|relu; windows_per_warp, ntile: the kernel's tile (WPW, NT),
            NT a multiple of 64 (the swizzle needs at least 8 column groups per row); dtype: arithmetic dtype.

    Returns:
        :class:`TcKernelReplay`.

    Raises:
        ValueError: unknown activation, a tile the kernel cannot have, or ``x`` of the wrong K.
    """
    if activation not in ("none", "relu"):
        raise ValueError(f"unknown activation {activation!r}; known: none, relu")
    if ntile <= 0 or ntile % 64 or windows_per_warp < 1:
        raise ValueError(f"tile (windows_per_warp={windows_per_warp}, ntile={ntile}): ntile must be a multiple of 64")
    k, n = x.shape
    if k != plan.k:
        raise ValueError(f"x has K = {k}, the plan was built for K = {plan.k}")
    device = plan.frag_values.device
    cpr = ntile // 8  # 16-byte column groups per staged row (CPR)
    n_blocks = -(-n // ntile)  # gridDim.y
    chunks = plan.num_chunks
    lane = torch.arange(LANES, device=device)
    nan = float("nan")

    # stage_chunk: every (chunk, column block) buffer, poisoned first so a group no copy writes would show.
    xpad = torch.zeros(chunks * K_CHUNK, n_blocks * ntile, dtype=dtype, device=device)
    xpad[:k, :n] = x.to(device=device, dtype=dtype)
    r = torch.arange(K_CHUNK, device=device)[:, None]
    c = torch.arange(cpr, device=device)[None, :]
    dst = (r * cpr + (c ^ (r & 7))).reshape(-1)
    smem = torch.full((chunks, n_blocks, K_CHUNK * cpr, 8), nan, dtype=dtype, device=device)
    groups = xpad.view(chunks, K_CHUNK, n_blocks, cpr, 8).permute(0, 2, 1, 3, 4)
    smem[:, :, dst] = groups.reshape(chunks, n_blocks, K_CHUNK * cpr, 8)

    # Segment of every k-step, as the kernel reaches it: kstep_offsets[w * num_chunks + ch] .. [+ 1].
    counts = (plan.kstep_offsets[1:] - plan.kstep_offsets[:-1]).long()
    seg_of_kstep = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts)
    window_of_kstep = seg_of_kstep // chunks
    chunk_of_kstep = seg_of_kstep % chunks
    ksteps = plan.ksteps

    # segment_mma: ldmatrix row addresses (16-byte group index in the chunk's buffer), (ksteps, NT / 16, 32).
    slot = lane & (K_STEP - 1)
    half = lane >> 4
    r_cur = plan.slot_rows.long()[:, slot]  # (ksteps, 32)
    sw = r_cur & 7
    c_grp = 2 * torch.arange(cpr // 2, device=device)[:, None] + half[None, :]  # (NT / 16, 32)
    addr = r_cur[:, None, :] * cpr + (c_grp[None] ^ sw[:, None, :])
    rows16 = smem[
        chunk_of_kstep[:, None, None, None],
        torch.arange(n_blocks, device=device)[None, :, None, None],
        addr[:, None],
    ]  # (ksteps, n_blocks, NT / 16, 32 address lanes, 8 elements)
    # ldmatrix .trans: register i of lane l = rows 2 * (l % 4) + {0, 1} of matrix i (lanes 8i .. 8i + 7), column l / 4.
    reg = torch.arange(4, device=device)[None, :, None]
    e = torch.arange(2, device=device)[None, None, :]
    src_lane = 8 * reg + 2 * (lane[:, None, None] & 3) + e  # (32, 4, 2)
    b_regs = rows16[..., src_lane, (lane >> 2)[:, None, None].expand_as(src_lane)]  # (..., NT/16, 32, 4 regs, 2)
    # Registers {0, 1} -> mma of n8 tile 2 * j2, {2, 3} -> tile 2 * j2 + 1: (ksteps, n_blocks, NT / 8, 32, 2 regs, 2).
    shape = b_regs.shape
    b_regs = b_regs.view(*shape[:3], LANES, 2, 2, 2).permute(0, 1, 2, 4, 3, 5, 6).reshape(*shape[:2], cpr, LANES, 2, 2)
    # B tile from the fragment table: b_(2 * reg + e) of lane l.
    b_row, b_col = _mma_b_coords(lane[:, None, None], 2 * torch.arange(2, device=device)[None, :, None] + e)
    b_tile = torch.full((*shape[:2], cpr, K_STEP, 8), nan, dtype=dtype, device=device)
    b_tile[..., b_row, b_col] = b_regs
    # A tile: lane l's 16 bytes of frag_values are registers a.x .. a.w = (a0, a1) .. (a6, a7), low half first.
    i8 = torch.arange(FRAG_ELEMS, device=device)[None, :]
    a_row, a_col = _mma_a_coords(lane[:, None], i8)
    a_tile = torch.full((ksteps, WINDOW_ROWS, K_STEP), nan, dtype=dtype, device=device)
    a_tile[:, a_row, a_col] = plan.frag_values.to(dtype)
    d_tile = a_tile[:, None, None] @ b_tile  # (ksteps, n_blocks, NT / 8, 16, 8)
    c_row, c_col = _mma_c_coords(lane[:, None], torch.arange(4, device=device)[None, :])
    c_frag = d_tile[..., c_row, c_col]  # (ksteps, n_blocks, NT / 8, 32, 4): each lane's accumulator increments
    acc = torch.zeros(plan.num_windows, *c_frag.shape[1:], dtype=dtype, device=device)
    acc.index_add_(0, window_of_kstep, c_frag)

    # Grid: block bx, warp, wi -> window bx * (8 * WPW) + warp * WPW + wi, skipped past num_windows.
    per_block = KERNEL_WARPS * windows_per_warp
    bx = torch.arange(-(-plan.num_windows // per_block), device=device)[:, None, None]
    warp = torch.arange(KERNEL_WARPS, device=device)[None, :, None]
    wi = torch.arange(windows_per_warp, device=device)[None, None, :]
    visits = (bx * per_block + warp * windows_per_warp + wi).reshape(-1)
    visits = visits[visits < plan.num_windows]

    # Epilogue: c0, c1 at window row gid, c2, c3 at gid + 8; columns n0 + 8 j + 2 tig + {0, 1}.
    hh = torch.arange(2, device=device)
    out_row = plan.window_rows.long()[visits[:, None, None] * WINDOW_ROWS + (lane >> 2)[None, :, None] + 8 * hh]
    by = torch.arange(n_blocks, device=device)[:, None, None, None]
    jj = torch.arange(cpr, device=device)[None, :, None, None]
    out_col = by * ntile + 8 * jj + 2 * (lane & 3)[None, None, :, None] + hh[None, None, None, :]  # (nb, NT/8, 32, 2)
    vals = acc[visits].view(visits.numel(), n_blocks, cpr, LANES, 2, 2)  # (..., h, pair element)
    row_b = out_row[:, None, None, :, :, None].expand_as(vals)
    col_b = out_col[None, :, :, :, None, :].expand_as(vals)
    if bias is not None:
        bias_d = bias.to(device=device, dtype=dtype)
        vals = vals + torch.where(row_b >= 0, bias_d[row_b.clamp(min=0)], torch.zeros((), dtype=dtype, device=device))
    if activation == "relu":
        vals = torch.relu(vals)
    store = (row_b >= 0) & (col_b < n)
    y = torch.full((plan.m, n), nan, dtype=dtype, device=device)
    writes = torch.zeros(plan.m, n, dtype=torch.int64, device=device)
    y.index_put_((row_b[store], col_b[store]), vals[store])
    writes.index_put_((row_b[store], col_b[store]), torch.ones_like(row_b[store]), accumulate=True)

    # Bank conflicts of each 8x8 matrix: distinct 16-byte groups sharing a bank line position (group % 8) serialise.
    if ksteps:
        mats = addr.view(ksteps, cpr // 2, 4, LDMATRIX_ROWS).sort(-1).values
        first = torch.ones_like(mats, dtype=torch.bool)
        first[..., 1:] = mats[..., 1:] != mats[..., :-1]
        per_pos = torch.zeros(*mats.shape[:-1], 8, dtype=torch.int64, device=device)
        per_pos.scatter_add_(-1, mats % 8, first.long())
        wavefronts = float(per_pos.max(-1).values.double().mean())
    else:
        wavefronts = 1.0
    return TcKernelReplay(y=y, writes=writes, wavefronts=wavefronts)
