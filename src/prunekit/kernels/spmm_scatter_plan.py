"""Scatter-record plan for the decode tensor-core SpMM (``spmm_scatter.cu``, variant ``"scatter"``, N <= 16).

The sparse weight ``A (M, K)`` is cut into *strips* of :data:`STRIP_ROWS` = 8 rows (the ``n = 8`` operand of
``mma.sync.m16n8k16``; the N <= 16 tokens are the ``m = 16`` operand) and *groups* of :data:`GROUP_COLS` = 128
columns. ``strip_rows=16`` (opt-in; slower than 8 at most decode points on the H100, docs/KERNELS.md) makes the
strip the ``m = 16`` operand instead, read with ``ldmatrix.x4`` as A fragments, and the tokens the ``n = 8`` operand (two mma per k-step for N > 8): half the X
fragment loads and half the tile flushes per weight. Every stored non-zero becomes one 32-bit *record*: its value's 16 bits (fp16 or bf16) in the low half and,
in the high half, its position in the group's dense 8 x 128 tile as the kernel lays that tile out in shared memory
(:func:`tile_position`). Records are sorted by (strip, group), and ``group_offsets`` gives each (strip, group)'s
range (within it, round-robin over the shared-memory banks, :func:`record_order`), so a warp scatters a group's records into a zeroed tile with one 2-byte store each and multiplies the tile
densely on tensor cores. 4 bytes per non-zero, like CSR with int16 column indices, with no row padding.

Tile layout (:func:`tile_position`): row ``r`` of the tile is 256 bytes, sixteen 16-byte column groups of 8 slots;
k-step ``t`` (columns ``16 t .. 16 t + 15`` of the group) owns column groups ``2 t`` (slots 0-7) and ``2 t + 1``
(slots 8-15). Column group ``c`` of row ``r`` is stored at ``c ^ r`` (XOR swizzle), so the eight rows of one 8 x 8
``ldmatrix`` matrix fall in distinct shared-memory banks. Within a k-step, slot ``2 q + j`` holds column ``4 q + j``
and slot ``8 + 2 q + j`` holds column ``4 q + 2 + j`` (``q < 4``, ``j < 2``): the A fragment of ``m16n8k16`` gives
lane ``4 g + q`` the k slots ``2 q, 2 q + 1, 2 q + 8, 2 q + 9``, so with this order they are the four adjacent
columns ``4 q .. 4 q + 3`` of X, one 8-byte load (PTX ISA, "Matrix Fragments for mma.m16n8k16").

CSR padding entries (they repeat their row's last column with value 0, ``formats/csr.py``) are dropped: two records
at one position would race in the scatter. :func:`scatter_plan_matmul` multiplies with exactly the plan's data
(positions decoded back through the swizzle and slot order), so the CPU tests verify the index math without a GPU.
Everything is vectorised torch on the weight's device. torch only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..formats.csr import csr_rows
from .tensor_cache import cached

STRIP_ROWS = 8  # mma n: rows of A per strip (one warp's output rows); 16 (the mma's m) is the opt-in alternative
STRIP_ROWS_CHOICES = (8, 16)
GROUP_COLS = 128  # columns of A per scattered tile: 8 k-steps of 16
K_STEP = 16
MAX_TOKENS = 16  # mma m: columns of X (tokens) the kernel takes
_CACHE_ATTR = "_prunekit_scatter_plan"

__all__ = [
    "GROUP_COLS",
    "MAX_TOKENS",
    "STRIP_ROWS",
    "STRIP_ROWS_CHOICES",
    "ScatterPlan",
    "build_scatter_plan",
    "csr_entries",
    "emulated_matmul",
    "get_scatter_plan",
    "record_positions",
    "record_values",
    "scatter_plan_matmul",
    "slot_of_column",
    "tile_position",
]


@dataclass(frozen=True)
class ScatterPlan:
    """Scatter records of one sparse weight for ``spmm_scatter.cu`` (module docstring).

    Attributes:
        records: ``(nnz,)`` int32; bits 0-15 the value's fp16/bf16 bits, bits 16-25 the tile position.
        group_offsets: ``(strips * groups + 1,)`` int32; records of (strip s, group g) are
            ``records[group_offsets[s * groups + g] : group_offsets[s * groups + g + 1]]``.
        m, k: the weight's shape. strips: ``ceil(M / strip_rows)``. groups: ``ceil(K / 128)`` (at least 1).
        dtype: the values' dtype (float16 or bfloat16).
        strip_rows: rows per strip, 8 (default; the mma's n operand) or 16 (the m operand).
        workspace: ``(strips * strip_rows * 16,)`` float32 zeros, counters: ``(strips,)`` int32 zeros: the k-split
            reduction (each launch leaves them zero again). They live with the plan, so a CUDA graph that captured
            a call keeps valid pointers; two calls of one weight running concurrently on two streams would share
            them (not supported).
    """

    records: torch.Tensor
    group_offsets: torch.Tensor
    m: int
    k: int
    strips: int
    groups: int
    dtype: torch.dtype
    strip_rows: int
    workspace: torch.Tensor
    counters: torch.Tensor

    @property
    def nnz(self) -> int:
        """Number of records (stored non-zeros without the CSR padding)."""
        return self.records.numel()

    @property
    def nbytes(self) -> int:
        """Bytes the kernel streams: records and group offsets (the workspace and counters add 516 bytes per strip)."""
        return self.records.numel() * 4 + self.group_offsets.numel() * 4


def slot_of_column(col16: torch.Tensor) -> torch.Tensor:
    """Slot (0-15) of each column ``col16`` (0-15) within a k-step: ``4 q + j`` -> ``2 q + j`` for ``j < 2``, else
    ``8 + 2 q + j - 2`` (module docstring). Any integer dtype; returns the same dtype."""
    q, j = col16 // 4, col16 % 4
    return torch.where(j < 2, 2 * q + j, 8 + 2 * q + (j - 2))


def column_of_slot(slot: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`slot_of_column`."""
    half, s = slot // 8, slot % 8
    return 4 * (s // 2) + 2 * half + s % 2


def tile_position(row: torch.Tensor, col128: torch.Tensor) -> torch.Tensor:
    """Halfword index in the kernel's swizzled ``strip_rows x 128`` shared-memory tile of row ``row`` (0-7, or 0-15
    for 16-row strips) and column ``col128`` (0-127) of a group: 16-byte column group ``c`` of row ``r`` sits at
    ``c ^ (r % 8)`` (module docstring)."""
    t, c = col128 // K_STEP, col128 % K_STEP
    slot = slot_of_column(c)
    group16 = 2 * t + slot // 8
    return row * GROUP_COLS + torch.bitwise_xor(group16, row % 8) * 8 + slot % 8


def _decode_position(pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row8, col128) of tile positions: the inverse of :func:`tile_position`."""
    row = pos // GROUP_COLS
    phys = pos % GROUP_COLS
    group16 = torch.bitwise_xor(phys // 8, row % 8)
    slot = (group16 % 2) * 8 + phys % 8
    return row, (group16 // 2) * K_STEP + column_of_slot(slot)


def record_order(segment: torch.Tensor, position: torch.Tensor, strip_rows: int = STRIP_ROWS) -> torch.Tensor:
    """Order of the records: by segment, and within a segment round-robin over the 32 shared-memory banks.

    The kernel stores 32 consecutive records per instruction; records in one bank (``(position // 2) % 32``) but in
    different 4-byte words serialise. Within a segment the r-th record of each bank (by position) comes before any
    (r + 1)-th, banks ascending, so any 32 consecutive records of a segment hit distinct banks as long as the banks
    they come from still have records (at most ``4 * strip_rows`` positions per bank in a tile of ``strip_rows * 128``
    halfwords, so ``segment * strip_rows * 128 + rank * 32 + bank`` is a unique key).

    Args:
        segment: ``(nnz,)`` int64 ``strip * groups + group``; position: ``(nnz,)`` tile positions, distinct within a
            segment; strip_rows: 8 or 16.

    Returns:
        ``(nnz,)`` int64 permutation.
    """
    if segment.numel() == 0:
        return torch.zeros(0, dtype=torch.int64, device=segment.device)
    position = position.long()
    bank = (position // 2) % 32
    tile = strip_rows * GROUP_COLS
    by_bank = torch.argsort((segment * 32 + bank) * tile + position)
    run = (segment * 32 + bank)[by_bank]
    _, counts = torch.unique_consecutive(run, return_counts=True)
    starts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    rank = torch.arange(run.numel(), device=run.device) - starts
    key = segment[by_bank] * tile + rank * 32 + bank[by_bank]
    return by_bank[torch.argsort(key)]


def csr_entries(
    values: torch.Tensor, row_offsets: torch.Tensor, column_indices: torch.Tensor, m: int, k: int, kernel: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stored entries of a prunekit CSR weight for a decode plan builder, checked: ``(rows, cols, keep)``, each
    ``(nnz_padded,)`` on the values' device (int64 row and column of every stored entry; ``keep`` False for the CSR
    padding entries, which repeat their row's last column with value 0, ``formats/csr.py``).

    Raises:
        ValueError: values not float16/bfloat16 (naming ``kernel``), shapes that disagree or a column index outside
            ``[0, K)``.
    """
    if values.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the {kernel} SpMM takes float16 or bfloat16 weights, got {values.dtype}")
    if row_offsets.numel() != m + 1 or values.numel() != column_indices.numel():
        raise ValueError(
            f"CSR shapes disagree: row_offsets {row_offsets.numel()} (expected M + 1 = {m + 1}), "
            f"values {values.numel()}, column_indices {column_indices.numel()}"
        )
    device = values.device
    rows = csr_rows(row_offsets.to(device))
    cols = column_indices.to(device).long()
    if cols.numel() and (int(cols.min()) < 0 or int(cols.max()) >= k):
        raise ValueError(f"column index outside [0, {k})")
    keep = torch.ones_like(cols, dtype=torch.bool)
    if cols.numel() > 1:
        keep[1:] = (rows[1:] != rows[:-1]) | (cols[1:] != cols[:-1])
    return rows, cols, keep


def build_scatter_plan(
    values: torch.Tensor,
    row_offsets: torch.Tensor,
    column_indices: torch.Tensor,
    m: int,
    k: int,
    strip_rows: int = STRIP_ROWS,
) -> ScatterPlan:
    """Build the scatter records of a prunekit CSR weight (module docstring), on the weight's device.

    Args:
        values: ``(nnz_padded,)`` float16 or bfloat16; row_offsets: ``(M + 1,)`` int32; column_indices:
            ``(nnz_padded,)`` int16/int32 (padding entries repeat the row's last column, ``formats/csr.py``);
        m, k: the weight's shape ``(M, K)``; strip_rows: 8 (default) or 16 rows per strip.

    Returns:
        :class:`ScatterPlan`.

    Raises:
        ValueError: values not float16/bfloat16, shapes that disagree, a column index outside ``[0, K)`` or
            ``strip_rows`` not 8 or 16.
    """
    if strip_rows not in STRIP_ROWS_CHOICES:
        raise ValueError(f"strip_rows must be 8 or 16, got {strip_rows}")
    rows, cols, keep = csr_entries(values, row_offsets, column_indices, m, k, "scatter")
    device = values.device
    strips = -(-m // strip_rows)
    groups = max(1, -(-k // GROUP_COLS))
    rows, cols = rows[keep], cols[keep]
    bits = values.contiguous().view(torch.int16)[keep].to(torch.int32) & 0xFFFF
    segment = (rows // strip_rows) * groups + cols // GROUP_COLS
    position = tile_position(rows % strip_rows, cols % GROUP_COLS)
    records = bits | (position.to(torch.int32) << 16)
    order = record_order(segment, position, strip_rows)
    counts = torch.bincount(segment, minlength=strips * groups)
    offsets = torch.zeros(strips * groups + 1, dtype=torch.int64, device=device)
    torch.cumsum(counts, 0, out=offsets[1:])
    if offsets[-1] >= 2**31:
        raise ValueError("too many non-zeros for int32 record offsets")
    return ScatterPlan(
        records=records[order].contiguous(),
        group_offsets=offsets.to(torch.int32),
        m=m,
        k=k,
        strips=strips,
        groups=groups,
        dtype=values.dtype,
        strip_rows=strip_rows,
        workspace=torch.zeros(strips * strip_rows * MAX_TOKENS, dtype=torch.float32, device=device),
        counters=torch.zeros(strips, dtype=torch.int32, device=device),
    )


def get_scatter_plan(
    values: torch.Tensor,
    row_offsets: torch.Tensor,
    column_indices: torch.Tensor,
    m: int,
    k: int,
    strip_rows: int = STRIP_ROWS,
) -> ScatterPlan:
    """:func:`build_scatter_plan` cached on ``values`` (``tensor_cache.cached``: rebuilt when values, indices or
    offsets change in place or by identity, or M, K, dtype, device or ``strip_rows`` change), like the ``tc`` plan."""
    extra = (m, k, values.dtype, values.device, strip_rows)
    return cached(
        values,
        _CACHE_ATTR,
        (values, column_indices, row_offsets),
        extra,
        lambda: build_scatter_plan(values, row_offsets, column_indices, m, k, strip_rows),
    )


def record_values(plan: ScatterPlan, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``(nnz,)`` the records' values (their low 16 bits read as ``plan.dtype``), in ``dtype``."""
    bits = (plan.records.long() & 0xFFFF).to(torch.int32)
    bits = torch.where(bits >= 2**15, bits - 2**16, bits).to(torch.int16)
    return bits.view(plan.dtype).to(dtype)


def record_positions(plan: ScatterPlan) -> torch.Tensor:
    """``(nnz,)`` int64 the records' tile positions (:func:`tile_position`)."""
    return plan.records.long() >> 16


def scatter_plan_dense(plan: ScatterPlan, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The dense ``(M, K)`` weight the plan's records describe (decoded through the tile layout), in ``dtype``."""
    device = plan.records.device
    vals = record_values(plan, dtype)
    counts = plan.group_offsets[1:].long() - plan.group_offsets[:-1].long()
    segment = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts)
    row8, col128 = _decode_position(record_positions(plan))
    rows = (segment // plan.groups) * plan.strip_rows + row8
    cols = (segment % plan.groups) * GROUP_COLS + col128
    dense = torch.zeros(plan.strips * plan.strip_rows, plan.groups * GROUP_COLS, dtype=dtype, device=device)
    dense.index_put_((rows, cols), vals, accumulate=True)
    return dense[: plan.m, : plan.k]


def scatter_plan_matmul(
    plan: ScatterPlan,
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """CPU emulation of ``spmm_scatter.cu``: ``Y (M, N) = act(A @ X + bias)`` from the plan's records only.

    Args:
        plan: from :func:`build_scatter_plan`; x: ``(K, N)``; bias: ``(M,)`` or None; activation: none|relu;
        dtype: compute dtype (float64 by default).

    Returns:
        ``(M, N)`` in ``dtype``.

    Raises:
        ValueError: unknown activation or an X whose K differs from the plan's.
    """
    return emulated_matmul(lambda: scatter_plan_dense(plan, dtype), plan.k, x, bias, activation)


def emulated_matmul(
    weight: Callable[[], torch.Tensor],
    k: int,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
) -> torch.Tensor:
    """``act(W @ X + bias)`` for a plan's CPU emulation: ``weight()`` decodes ``W (M, K)`` from the plan (called after
    the checks), ``x (K, N)``, ``bias (M,)`` or None; computed in W's dtype and device.

    Raises:
        ValueError: unknown activation or an X whose K differs from ``k``.
    """
    if activation not in ("none", "relu"):
        raise ValueError(f"unknown activation {activation!r}; known: none, relu")
    if x.dim() != 2 or x.shape[0] != k:
        raise ValueError(f"x must be (K, N) with K = {k}, got {tuple(x.shape)}")
    w = weight()
    y = w @ x.to(device=w.device, dtype=w.dtype)
    if bias is not None:
        y = y + bias.to(device=y.device, dtype=y.dtype)[:, None]
    return torch.relu(y) if activation == "relu" else y
