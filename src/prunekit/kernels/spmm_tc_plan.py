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
conflict-free exactly when the 8 rows have distinct ``r % 8``. The plan therefore orders a segment's union columns
"rank-major by residue": column ``kl`` with residue ``kl % 8`` that is the ``g``-th union column of its residue goes
before every column of rank ``g + 1``, residues ascending within a rank. While every residue still has columns the
groups of 8 slots hold 8 distinct residues; only the tail of a segment can repeat one
(:attr:`TcPlan.conflict_factor` measures it).

Optional row reordering (``row_order``): the window slots take the rows in the given order and the kernel writes each
output row back to its real position (``window_rows``), so a permutation that puts rows with similar column sets in
one window shrinks the unions at no runtime cost.

Everything here is vectorised torch (no Python loop over rows or segments) and runs on the weight's device.
:func:`tc_plan_matmul` multiplies with exactly the plan's data (fragment order, slot rows, padding, row order): the CPU
tests check it against float64 so the index math is verified without a GPU. torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats.csr import csr_rows

WINDOW_ROWS = 16  # mma.sync.m16n8k16: the weight window is the A operand, m = 16 rows
K_STEP = 16  # mma.sync.m16n8k16: k = 16 per instruction
K_CHUNK = 256  # X rows per shared-memory stage; chunk-local rows fit uint8 (docs/KERNELS.md: padding vs chunk size)
LDMATRIX_ROWS = 8  # one 8x8 matrix of ldmatrix reads 8 row addresses
LANES = 32
FRAG_ELEMS = 8  # A-fragment elements per lane (4 x 32-bit registers of 2 halves)
_WINDOW_SHIFT = WINDOW_ROWS.bit_length() - 1
_CHUNK_SHIFT = K_CHUNK.bit_length() - 1
_KSTEP_SHIFT = K_STEP.bit_length() - 1

__all__ = [
    "K_CHUNK",
    "K_STEP",
    "WINDOW_ROWS",
    "TcPlan",
    "build_tc_plan",
    "fragment_index",
    "get_tc_plan",
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
    # elementwise passes over the non-zeros.
    slot_pos = rows.int() if row_order is None else pos_of_row[rows].int()  # window slot of every entry
    cols32 = cols.int()
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
    # Sequence order: rank-major, residue-minor. (rank g, residue r) exists when counts[s, r] > g.
    ranks = torch.arange(K_CHUNK // LDMATRIX_ROWS, device=device)
    exists = (counts[:, None, :] > ranks[None, :, None]).view(num_segments, K_CHUNK)
    seq_pos = torch.cumsum(exists, 1, dtype=torch.int32) - exists.int()  # exclusive
    union = counts.sum(1)
    ksteps_per_segment = (union + K_STEP - 1) // K_STEP
    kstep_offsets = torch.zeros(num_segments + 1, dtype=torch.int64, device=device)
    kstep_offsets[1:] = torch.cumsum(ksteps_per_segment, 0)
    total_ksteps = int(kstep_offsets[-1])

    # Slot of every union column: segment base + its sequence position.
    union_key = torch.nonzero(present).squeeze(1)
    seg = union_key // K_CHUNK
    local = union_key % K_CHUNK
    residue = local % LDMATRIX_ROWS
    rank_u = rank.view(-1)[union_key].long()
    slot_global = kstep_offsets[seg] * K_STEP + seq_pos[seg, rank_u * LDMATRIX_ROWS + residue].long()
    # Padding slots read chunk row (slot % 8): the residue a full group would have there; the weight there is 0.
    slot_rows = (torch.arange(total_ksteps * K_STEP, device=device) % LDMATRIX_ROWS).to(torch.uint8)
    slot_rows[slot_global] = local.to(torch.uint8)
    slot_of_key = torch.empty(num_segments * K_CHUNK, dtype=torch.int64, device=device)
    slot_of_key[union_key] = slot_global
    del union_key, seg, local, residue, rank_u, present, grid, rank, exists, seq_pos

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


_CACHE_ATTR = "_prunekit_tc_plan"  # attribute on the stored values tensor: (key, plan)


def get_tc_plan(
    values: torch.Tensor, row_offsets: torch.Tensor, column_indices: torch.Tensor, m: int, k: int
) -> TcPlan:
    """:func:`build_tc_plan` cached on ``values`` (rebuilt when values, indices or shape change in place or by identity).

    The key holds ``values``' data pointer and version counter and the indices' data pointers, like the cuSPARSELt
    weight cache in ``structured.py``; the plan lives as long as the stored values tensor.
    """
    key = (
        values.data_ptr(),
        values._version,
        column_indices.data_ptr(),
        column_indices._version,
        row_offsets.data_ptr(),
        m,
        k,
        values.dtype,
    )
    hit = getattr(values, _CACHE_ATTR, None)
    if hit is not None and hit[0] == key:
        return hit[1]
    plan = build_tc_plan(values, row_offsets, column_indices, m, k)
    setattr(values, _CACHE_ATTR, (key, plan))
    return plan


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
