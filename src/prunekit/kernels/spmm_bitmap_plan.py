"""Bitmap plan for the decode tensor-core SpMM (variant ``"bitmap"``, ``Y (M, N) = act(A @ X + bias)``; the kernel
multiplies each tile by 16 tokens at N <= 16 and by 32 or 64 tokens per block above, the same plan).

The idea of streaming a bitmap-compressed weight from global memory and expanding it into dense tensor-core tiles
("load sparse, compute dense") is from Flash-LLM (Xia et al., VLDB 2024) and SpInfer (Fan et al., EuroSys 2025). The
layout below is prunekit's own: the bitmap's unit is one *pair register* of the ``mma.sync.m16n8k16`` A fragment,
with the columns ``4 t .. 4 t + 3`` permutation that the register-expansion path of prunekit's nm24 decode kernel
uses (``nm24.py``), so a lane's present pairs land straight in its A registers.

The sparse weight ``A (M, K)`` (fp16 or bf16) is the mma's A operand (16 rows x 16 columns per k-step); the N <= 16
tokens are the B operand. A is cut into *strips* of :data:`STRIP_ROWS` = 16 rows (``strips = ceil(M / 16)``) and
*k-steps* of :data:`K_STEP` = 16 columns; ``ksteps = ceil(K / 16)`` rounded up to a multiple of :data:`BATCH` = 8
(columns past K are zero). A *tile* is (strip s, k-step j): rows ``16 s .. 16 s + 15``, columns ``16 j .. 16 j + 15``
(zero outside ``M x K``).

Pair registers (:func:`pair_coords`): in a tile, lane ``l`` (0-31, ``g = l // 4``, ``t = l % 4``) owns four 32-bit
words ``r = 0..3``, each two adjacent columns of one row, the even column's 16 bits low and the odd column's high:
``r = 0``: row ``g``, columns ``4 t, 4 t + 1``; ``r = 1``: row ``g + 8``, the same columns; ``r = 2``: row ``g``,
columns ``4 t + 2, 4 t + 3``; ``r = 3``: row ``g + 8``, the same (rows relative to the strip, columns to the tile).
Every element of the tile belongs to exactly one (lane, r, half). A pair is *present* when either of its values is
non-zero (values are compared, so -0.0 is zero; a zero element of a present pair is stored as 0x0000).

Data (:class:`BitmapPlan`):

- ``vals``: ``(words,)`` int32, the present pairs' words ordered by (strip, k-step, lane, r) without padding between
  tiles or strips, then 4 zero words (the kernel copies 16-byte pieces and may read up to 3 words past the end).
- ``hdr``: ``(strips, ksteps, 5)`` int32 per tile. Words 0-3: mask word ``w`` holds lanes ``8 w .. 8 w + 7``, bit
  ``4 (l - 8 w) + r`` set when lane ``l``'s pair ``r`` is present (the lane's nibble is
  ``(hdr[w] >> 4 (l % 8)) & 15``). Word 4: byte 0 the tile's number of present pairs (0-128), byte ``w`` (1-3) the
  number of present pairs of lanes ``< 8 w``.
- ``boff``: ``(strips, ksteps / 8 + 1)`` int32; ``boff[s, b]`` is the index in ``vals`` of the first word of strip s's
  k-steps ``8 b .. 8 b + 7``, ``boff[s, ksteps / 8]`` the end of strip s's words.
- All of it lives in one int32 ``buffer`` (the eager entry ``prunekit_nm24::bitmap_linear`` takes just that):
  ``hdr``, ``boff``, the kernel's fp32 workspace ``ws`` and its ``counters`` (each padded to 4 words), then ``vals``;
  :func:`buffer_layout` gives the sizes from M and K alone, as the C++ entry computes them.

Lane ``l`` of a tile reads its words from ``tile_base + prefix_byte(l // 8) + popcount(mask_word(l // 8) & ((1 << 4
(l % 8)) - 1))``, present pairs in increasing r, where ``tile_base`` is ``boff[s, j // 8]`` plus the totals (byte 0
of word 4) of the batch's earlier tiles. ``slot_words`` bounds the 16-byte-aligned span of any batch (the kernel's
shared-memory slot). :func:`bitmap_plan_dense` decodes the weight from ``hdr``, ``boff`` and ``vals`` with exactly
this arithmetic, so the CPU tests check the format and the kernel's index math without a GPU. Everything is
vectorised torch on the weight's device. torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .spmm_scatter_plan import csr_entries, emulated_matmul
from .tensor_cache import cached

STRIP_ROWS = 16  # mma m: rows of A per strip (the A operand of mma.sync.m16n8k16)
K_STEP = 16  # mma k: columns of A per tile
BATCH = 8  # k-steps per batch (one shared-memory slot of the kernel); ksteps is a multiple of it
HEADER_WORDS = 5  # per tile: 4 mask words (8 lanes x 4 pairs each) + 1 word of prefix counts
MAX_TOKENS = 16  # columns of X (tokens) per row of the plan's k-split workspace (the kernel's N <= 16 blocks)
TAIL_WORDS = 4  # zero words after the last pair: the kernel's 16-byte copies read up to 3 words past the end
MAX_WORDS = 2**31 - 16  # int32 word offsets, with room for the tail and the 16-byte rounding
_CACHE_ATTR = "_prunekit_bitmap_plan"

__all__ = [
    "BATCH",
    "HEADER_WORDS",
    "K_STEP",
    "MAX_TOKENS",
    "STRIP_ROWS",
    "BitmapPlan",
    "bitmap_bytes",
    "bitmap_plan_dense",
    "bitmap_plan_matmul",
    "bitmap_plan_nbytes",
    "buffer_layout",
    "build_bitmap_plan",
    "get_bitmap_plan",
    "pair_coords",
]


@dataclass(frozen=True)
class BitmapPlan:
    """Bitmap-compressed weight for the ``"bitmap"`` decode SpMM (module docstring).

    Attributes:
        vals: ``(pairs + 4,)`` int32, the present pairs' words by (strip, k-step, lane, r), then 4 zero words.
        hdr: ``(strips, ksteps, 5)`` int32, per tile 4 mask words and the packed counts word.
        boff: ``(strips, ksteps // 8 + 1)`` int32, word offsets of each strip's batches of 8 k-steps, and its end.
        ws: ``(strips * 16 * 16,)`` float32 zeros, counters: ``(ceil(strips / 8),)`` int32 zeros: the kernel's k-split
            workspace (each launch leaves them zero again). They live with the plan, so a CUDA graph that captured a
            call keeps valid pointers; two calls of one weight running concurrently on two streams would share them
            (not supported).
        m, k: the weight's shape. strips: ``ceil(M / 16)``. ksteps: ``ceil(K / 16)`` rounded up to a multiple of 8.
        slot_words: the most words one batch's 16-byte-aligned span holds (at least 4): the kernel's slot size.
        dtype: the values' dtype (float16 or bfloat16).
        buffer: ``(fixed + pairs + 4,)`` int32 holding all of the above (:func:`buffer_layout`); the tensors above are
            views into it.
    """

    vals: torch.Tensor
    hdr: torch.Tensor
    boff: torch.Tensor
    ws: torch.Tensor
    counters: torch.Tensor
    m: int
    k: int
    strips: int
    ksteps: int
    slot_words: int
    dtype: torch.dtype
    buffer: torch.Tensor

    @property
    def pairs(self) -> int:
        """Number of stored (present) pairs: ``vals`` without its 4 tail words."""
        return self.vals.numel() - TAIL_WORDS


def buffer_layout(m: int, k: int) -> tuple[int, int, int, int]:
    """Words of ``hdr``, ``boff``, ``ws`` and ``counters`` at the start of a plan's one buffer for ``A (m, k)``, each
    rounded up to a multiple of 4 (16-byte aligned pieces); ``vals`` follows them. The C++ entry
    (``bitmap_linear`` in ``nm24_decode.cu``) computes the same."""
    strips = -(-m // STRIP_ROWS)
    ksteps = -(-k // (K_STEP * BATCH)) * BATCH

    def pad4(words: int) -> int:
        return -(-words // 4) * 4

    return (
        strips * ksteps * HEADER_WORDS,  # a multiple of 40 words: ksteps is a multiple of 8
        pad4(strips * (ksteps // BATCH + 1)),
        strips * STRIP_ROWS * MAX_TOKENS,
        pad4(-(-strips // 8)),
    )


def pair_coords(lane: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row in the strip, even column in the tile) of pair register ``r`` (0-3) of ``lane`` (0-31): row ``lane // 4
    (+ 8 for odd r)``, columns ``4 (lane % 4) (+ 2 for r >= 2)`` and the next one (module docstring). Integer tensors
    of any (broadcastable) shape; returns int tensors of the broadcast shape."""
    return lane // 4 + 8 * (r % 2), 4 * (lane % 4) + 2 * (r // 2)


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 values in ``[0, 2**32)`` (or already signed) as int32 with the same 32 bits."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def _popcount32(x: torch.Tensor) -> torch.Tensor:
    """Set bits of each int64 ``x`` in ``[0, 2**32)`` (SWAR popcount; torch has no popcount op)."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) & 0xFFFFFFFF) >> 24


def _tiles(dense: torch.Tensor, strips: int, ksteps: int) -> torch.Tensor:
    """``(strips * 16, ksteps * 16)`` -> ``(strips, ksteps, 32 lanes, 4 r, 2 halves)`` in pair-register order: the
    ``(rh, g)`` row and ``(t, h, e)`` column split gives lane ``4 g + t``, ``r = 2 h + rh``, half ``e``."""
    x = dense.reshape(strips, 2, 8, ksteps, 4, 2, 2)  # (s, rh, g, j, t, h, e)
    return x.permute(0, 3, 2, 4, 5, 1, 6).reshape(strips, ksteps, 32, 4, 2)


def _untiles(tiles: torch.Tensor, strips: int, ksteps: int) -> torch.Tensor:
    """Inverse of :func:`_tiles`."""
    x = tiles.reshape(strips, ksteps, 8, 4, 2, 2, 2)  # (s, j, g, t, h, rh, e)
    return x.permute(0, 5, 2, 1, 3, 4, 6).reshape(strips * STRIP_ROWS, ksteps * K_STEP)


def build_bitmap_plan(
    values: torch.Tensor, row_offsets: torch.Tensor, column_indices: torch.Tensor, m: int, k: int
) -> BitmapPlan:
    """Build the bitmap plan of a prunekit CSR weight (module docstring), on the weight's device.

    Builds a zero-padded dense ``(strips * 16, ksteps * 16)`` copy of the weight in its dtype (2 bytes per element;
    CSR padding entries are dropped first, so every stored element is written once), then the pair words, masks and
    counts of every tile.

    Args:
        values: ``(nnz_padded,)`` float16 or bfloat16; row_offsets: ``(M + 1,)`` int32; column_indices:
            ``(nnz_padded,)`` int16/int32 (padding entries repeat the row's last column with value 0,
            ``formats/csr.py``); m, k: the weight's shape ``(M, K)``.

    Returns:
        :class:`BitmapPlan`.

    Raises:
        ValueError: values not float16/bfloat16, shapes that disagree, a column index outside ``[0, K)`` or
            ``2**31 - 16`` or more stored words.
    """
    rows, cols, keep = csr_entries(values, row_offsets, column_indices, m, k, "bitmap")
    device = values.device
    strips = -(-m // STRIP_ROWS)
    ksteps = -(-k // (K_STEP * BATCH)) * BATCH
    batches = ksteps // BATCH
    dense = torch.zeros(strips * STRIP_ROWS, ksteps * K_STEP, dtype=values.dtype, device=device)
    dense.index_put_((rows[keep], cols[keep]), values.contiguous()[keep])
    nonzero = dense != 0  # -0.0 is zero
    bits = torch.where(nonzero, dense, torch.zeros((), dtype=dense.dtype, device=device)).view(torch.int16)
    del dense

    present = _tiles(nonzero, strips, ksteps).any(-1)  # (strips, ksteps, 32, 4)
    halves = _tiles(bits, strips, ksteps)[present].to(torch.int32)  # (pairs, 2), in (s, j, lane, r) order
    del bits, nonzero
    pair_words = halves[:, 1] * 65536 + (halves[:, 0] & 0xFFFF)  # fits int32: |high| <= 2**15
    if pair_words.numel() >= MAX_WORDS:
        raise ValueError(f"{pair_words.numel()} stored words; the bitmap plan's int32 offsets take < 2**31 - 16")

    r_bit = torch.tensor([1, 2, 4, 8], dtype=torch.int32, device=device)
    nibbles = (present.to(torch.int32) * r_bit).sum(-1, dtype=torch.int64)  # (strips, ksteps, 32)
    lane_shift = 4 * torch.arange(8, device=device)
    masks = (nibbles.view(strips, ksteps, 4, 8) << lane_shift).sum(-1)  # (strips, ksteps, 4), in [0, 2**32)
    group_pairs = present.view(strips, ksteps, 4, 32).sum(-1)  # pairs of lanes 8w .. 8w + 7
    prefix = torch.cumsum(group_pairs, -1)  # [p1, p2, p3, total]
    counts = prefix[..., 3] | (prefix[..., 0] << 8) | (prefix[..., 1] << 16) | (prefix[..., 2] << 24)
    hdr = _to_int32(torch.cat([masks, counts[..., None]], -1)).contiguous()

    batch_pairs = prefix[..., 3].reshape(strips, batches, BATCH).sum(-1).reshape(-1)  # (strips * batches,)
    flat = torch.zeros(strips * batches + 1, dtype=torch.int64, device=device)
    torch.cumsum(batch_pairs, 0, out=flat[1:])
    boff = flat[torch.arange(strips, device=device)[:, None] * batches + torch.arange(batches + 1, device=device)]
    slot_words = TAIL_WORDS
    if batches and strips:
        start, end = boff[:, :-1], boff[:, 1:]
        span = (end + 3) // 4 * 4 - (start - start % 4)
        slot_words = max(slot_words, int(span.max()))
    n_hdr, n_boff, n_ws, n_cnt = buffer_layout(m, k)
    fixed = n_hdr + n_boff + n_ws + n_cnt
    buffer = torch.zeros(fixed + pair_words.numel() + TAIL_WORDS, dtype=torch.int32, device=device)
    buffer[:n_hdr] = hdr.view(-1)
    buffer[n_hdr : n_hdr + boff.numel()] = boff.view(-1)
    buffer[fixed : fixed + pair_words.numel()] = pair_words
    return BitmapPlan(
        vals=buffer[fixed:],
        hdr=buffer[:n_hdr].view(strips, ksteps, HEADER_WORDS),
        boff=buffer[n_hdr : n_hdr + boff.numel()].view(strips, batches + 1),
        ws=buffer[n_hdr + n_boff : n_hdr + n_boff + n_ws].view(torch.float32),
        counters=buffer[n_hdr + n_boff + n_ws : n_hdr + n_boff + n_ws + -(-strips // 8)],
        buffer=buffer,
        m=m,
        k=k,
        strips=strips,
        ksteps=ksteps,
        slot_words=slot_words,
        dtype=values.dtype,
    )


def bitmap_plan_nbytes(
    values: torch.Tensor, row_offsets: torch.Tensor, column_indices: torch.Tensor, m: int, k: int
) -> int:
    """Bytes of the plan :func:`build_bitmap_plan` would build (its one buffer, workspace included), without building
    it: the fixed part of :func:`buffer_layout` plus one word per present pair (a row's columns ``2c, 2c + 1``, either
    non-zero) plus the 4 tail words. Arguments as :func:`build_bitmap_plan`; cheap (one sort of the non-zeros).

    Raises:
        ValueError: as :func:`build_bitmap_plan`."""
    rows, cols, keep = csr_entries(values, row_offsets, column_indices, m, k, "bitmap")
    nonzero = keep & (values.to(rows.device) != 0)
    pairs = torch.unique(rows[nonzero] * (k // 2 + 1) + cols[nonzero] // 2).numel()
    return 4 * (sum(buffer_layout(m, k)) + pairs + TAIL_WORDS)


def get_bitmap_plan(
    values: torch.Tensor, row_offsets: torch.Tensor, column_indices: torch.Tensor, m: int, k: int
) -> BitmapPlan:
    """:func:`build_bitmap_plan` cached on ``values`` (``tensor_cache.cached``: rebuilt when values, indices or
    offsets change in place or by identity, or M, K, dtype or device change), like the ``scatter`` plan."""
    extra = (m, k, values.dtype, values.device)
    return cached(
        values,
        _CACHE_ATTR,
        (values, column_indices, row_offsets),
        extra,
        lambda: build_bitmap_plan(values, row_offsets, column_indices, m, k),
    )


def bitmap_plan_dense(plan: BitmapPlan, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The dense ``(M, K)`` weight decoded from the plan's ``hdr``, ``boff`` and ``vals`` only, in ``dtype``.

    Replays the kernel's per-lane index arithmetic for every tile and lane (module docstring): the tile's base is
    ``boff[s, j // 8]`` plus the totals (byte 0 of word 4) of the batch's earlier tiles; lane ``l``'s first word is
    the base plus the prefix byte ``l // 8`` plus the popcount of its mask word's lower nibbles; its present pairs
    follow in increasing r.
    """
    device = plan.vals.device
    strips, ksteps = plan.strips, plan.ksteps
    batches = ksteps // BATCH
    hdr = plan.hdr.long() & 0xFFFFFFFF  # (strips, ksteps, 5), unsigned
    totals = (hdr[..., 4] & 0xFF).view(strips, batches, BATCH)
    earlier = torch.cumsum(totals, -1) - totals
    tile_base = (plan.boff[:, :batches].long()[..., None] + earlier).view(strips, ksteps, 1)

    lane = torch.arange(32, device=device)
    w, sub = lane // 8, lane % 8
    mask = hdr[..., :4][..., w]  # (strips, ksteps, 32): each lane's mask word
    nibble = (mask >> (4 * sub)) & 15
    prefix_byte = torch.where(w > 0, (hdr[..., 4:5] >> (8 * w)) & 0xFF, 0)
    lane_first = tile_base + prefix_byte + _popcount32(mask & ((torch.ones_like(sub) << (4 * sub)) - 1))

    r = torch.arange(4, device=device)
    present = ((nibble[..., None] >> r) & 1).bool()  # (strips, ksteps, 32, 4)
    word_index = lane_first[..., None] + _popcount32(nibble[..., None] & ((torch.ones_like(r) << r) - 1))
    words = plan.vals.long()[torch.where(present, word_index, 0)] & 0xFFFFFFFF
    words = torch.where(present, words, 0)
    halves = torch.stack([words & 0xFFFF, words >> 16], -1)  # (strips, ksteps, 32, 4, 2)
    halves = torch.where(halves >= 2**15, halves - 2**16, halves).to(torch.int16).view(plan.dtype).to(dtype)
    return _untiles(halves, strips, ksteps)[: plan.m, : plan.k]


def bitmap_plan_matmul(
    plan: BitmapPlan,
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """CPU emulation of the bitmap SpMM: ``Y (M, N) = act(A @ X + bias)`` with A decoded from the plan only.

    Args:
        plan: from :func:`build_bitmap_plan`; x: ``(K, N)``; bias: ``(M,)`` or None; activation: none|relu;
        dtype: compute dtype (float64 by default).

    Returns:
        ``(M, N)`` in ``dtype``.

    Raises:
        ValueError: unknown activation or an X whose K differs from the plan's.
    """
    return emulated_matmul(lambda: bitmap_plan_dense(plan, dtype), plan.k, x, bias, activation)


def bitmap_bytes(plan: BitmapPlan) -> int:
    """Bytes the kernel streams per call: the stored words (without the 4 tail words), the tile headers and the batch
    offsets, 4 bytes each (the workspace and counters add 1024 + 0.5 bytes per strip and are not streamed)."""
    return plan.pairs * 4 + plan.hdr.numel() * 4 + plan.boff.numel() * 4
