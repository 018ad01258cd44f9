"""Pure-torch reference implementations of prunekit's sparse matmul ops.

These are the CPU implementations of the ``prunekit::`` custom ops and the oracle the
GPU kernels are tested against. Every op computes ``Y = act(A @ X + bias[:, None])``
with ``A`` sparse ``(M, K)`` in a kernel-ready format (see ``prunekit.formats``),
``X`` dense ``(K, N)`` (any strides), accumulation in float32 (float64 for float64
inputs), and ``Y`` dense ``(M, N)`` in ``X``'s dtype.

Intermediates are processed in chunks of at most :data:`CHUNK_ELEMENTS` elements so
large ``N`` does not blow up memory.
"""

from __future__ import annotations

import torch

from ..formats.csr import csr_rows
from ..formats.csr import csr_to_dense as csr_to_dense  # the `dense` variant's reference: the format's own decoding
from ..formats.nm import unpack_indices

CHUNK_ELEMENTS = 1 << 22
ACTIVATIONS = ("none", "relu")


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, else float32 (fp16/bf16/fp32 accumulate in fp32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _epilogue(acc: torch.Tensor, bias: torch.Tensor | None, activation: str, out_dtype: torch.dtype) -> torch.Tensor:
    if bias is not None:
        acc = acc + bias.to(acc.dtype)[:, None]
    if activation == "relu":
        acc = torch.relu(acc)
    elif activation != "none":
        raise ValueError(f"unknown activation {activation!r}; known: {', '.join(ACTIVATIONS)}")
    return acc.to(out_dtype)


def _chunk(rows_per_item: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, rows_per_item))


def spmm_csr(
    values: torch.Tensor,
    row_offsets: torch.Tensor,
    column_indices: torch.Tensor,
    row_indices: torch.Tensor,
    x: torch.Tensor,
    m: int,
    bias: torch.Tensor | None = None,
    activation: str = "none",
) -> torch.Tensor:
    """Sputnik SpMM (Gale et al. 2020): ``Y (M, N) = act(A @ X + bias)``, A in prunekit CSR.

    Args:
        values: ``(nnz_padded,)``; row_offsets: ``(M + 1,)`` int32; column_indices:
            ``(nnz_padded,)`` int16/int32; row_indices: ``(M,)`` int32 (unused here: an
            execution order); x: ``(K, N)``; m: M; bias: ``(M,)`` or None; activation: none|relu.
    """
    out = _scatter_products(values, csr_rows(row_offsets), column_indices.long(), x, m)
    return _epilogue(out, bias, activation, x.dtype)


def _scatter_products(
    values: torch.Tensor, scatter: torch.Tensor, gather: torch.Tensor, src: torch.Tensor, rows_out: int
) -> torch.Tensor:
    """``out[scatter[j]] += values[j] * src[gather[j]]`` over all non-zeros j, chunked; ``(rows_out, N)`` accumulator."""
    acc_dtype = accumulate_dtype(src.dtype)
    out = torch.zeros(rows_out, src.shape[1], dtype=acc_dtype, device=src.device)
    vals = values.to(acc_dtype)
    sa = src.to(acc_dtype)
    step = _chunk(src.shape[1])
    for start in range(0, vals.numel(), step):
        sl = slice(start, start + step)
        out.index_add_(0, scatter[sl], vals[sl, None] * sa[gather[sl]])
    return out


def spmm_csr_transposed(
    values: torch.Tensor,
    row_offsets: torch.Tensor,
    column_indices: torch.Tensor,
    dy: torch.Tensor,
    k: int,
) -> torch.Tensor:
    """``A^T @ dY``: the input gradient of :func:`spmm_csr` (scatter form, no transposed copy of A).

    Args:
        values: ``(nnz_padded,)``; row_offsets: ``(M + 1,)`` int32; column_indices: ``(nnz_padded,)`` int16/int32
            (padding entries hold value 0, so they add nothing); dy: ``(M, N)``; k: K.

    Returns:
        ``(K, N)`` in ``dy.dtype``, accumulated in float32 (float64 for float64) with ``index_add_`` (runs on any
        device; on CUDA it is atomics-based, not one of prunekit's tuned kernels).
    """
    return _scatter_products(values, column_indices.long(), csr_rows(row_offsets), dy, k).to(dy.dtype)


def bsr_mm(
    blocks: torch.Tensor,
    crow_indices: torch.Tensor,
    col_indices: torch.Tensor,
    x: torch.Tensor,
    m: int,
    bias: torch.Tensor | None = None,
    activation: str = "none",
) -> torch.Tensor:
    """Block-sparse matmul: ``Y (M, N) = act(A @ X + bias)``, A in BSR with ``blocks: (nblocks, r, c)``.

    Args:
        crow_indices: ``(M / r + 1,)`` int32; col_indices: ``(nblocks,)`` int32; x: ``(K, N)``.
    """
    acc_dtype = accumulate_dtype(x.dtype)
    r, c = blocks.shape[1], blocks.shape[2]
    k, n = x.shape
    out = torch.zeros(m // r, r, n, dtype=acc_dtype, device=x.device)
    counts = (crow_indices[1:] - crow_indices[:-1]).long()
    block_row = torch.repeat_interleave(torch.arange(m // r, device=x.device), counts)
    x_tiles = x.to(acc_dtype).reshape(k // c, c, n)
    cols = col_indices.long()
    step = _chunk(r * n)
    for start in range(0, blocks.shape[0], step):
        sl = slice(start, start + step)
        out.index_add_(0, block_row[sl], torch.bmm(blocks[sl].to(acc_dtype), x_tiles[cols[sl]]))
    return _epilogue(out.reshape(m, n), bias, activation, x.dtype)


def nm_columns(metadata: torch.Tensor, n: int, m_group: int, bits: int, k: int) -> torch.Tensor:
    """Absolute column of every stored N:M value, ``(M, K / m_group * n)`` int64."""
    per_row = k // m_group * n
    in_group = unpack_indices(metadata, bits, per_row)
    group_base = torch.arange(per_row, device=metadata.device) // n * m_group
    return in_group + group_base


def nm_mm(
    values: torch.Tensor,
    metadata: torch.Tensor,
    x: torch.Tensor,
    n: int,
    m_group: int,
    bits: int,
    bias: torch.Tensor | None = None,
    activation: str = "none",
) -> torch.Tensor:
    """N:M sparse matmul: ``Y (M, N) = act(A @ X + bias)``, A in prunekit's N:M format.

    Args:
        values: ``(M, K / m_group * n)``; metadata: packed in-group indices (uint8);
        x: ``(K, N)``; n, m_group: the N:M pattern; bits: bits per packed index.
    """
    acc_dtype = accumulate_dtype(x.dtype)
    rows, per_row = values.shape
    k, n_cols = x.shape
    cols = nm_columns(metadata, n, m_group, bits, k)
    xa = x.to(acc_dtype)
    vals = values.to(acc_dtype)
    out = torch.empty(rows, n_cols, dtype=acc_dtype, device=x.device)
    step = _chunk(per_row * n_cols)
    for start in range(0, rows, step):
        sl = slice(start, start + step)
        out[sl] = torch.einsum("rj,rjn->rn", vals[sl], xa[cols[sl]])
    return _epilogue(out, bias, activation, x.dtype)


def csr_padding_mask(row_offsets: torch.Tensor, column_indices: torch.Tensor) -> torch.Tensor:
    """``(nnz_padded,)`` bool, True at padding entries: those repeating the previous column of the same row.

    Real columns ascend strictly within a row and padding repeats the row's last real column (``formats/csr.py``),
    so this needs neither the values nor the real per-row counts.
    """
    rows = csr_rows(row_offsets)
    cols = column_indices.long()
    pad = torch.zeros(cols.numel(), dtype=torch.bool, device=cols.device)
    if cols.numel() > 1:
        pad[1:] = (cols[1:] == cols[:-1]) & (rows[1:] == rows[:-1])
    return pad


def sddmm_csr(
    row_offsets: torch.Tensor,
    column_indices: torch.Tensor,
    row_indices: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
) -> torch.Tensor:
    """Sputnik SDDMM (Gale et al. 2020, sec. 6): ``(A @ B^T)`` sampled at a prunekit CSR pattern.

    Args:
        row_offsets: ``(M + 1,)`` int32; column_indices: ``(nnz_padded,)`` int16/int32; row_indices: ``(M,)``
            int32 (an execution order, unused here); a: ``(M, K_inner)``; b: ``(N, K_inner)``, one float dtype.

    Returns:
        ``(nnz_padded,)`` in ``a.dtype``, aligned with the CSR ``values``: ``out[j] = a[row(j)] . b[col(j)]``
        accumulated in float32 (float64 for float64), 0 at padding entries.
    """
    acc_dtype = accumulate_dtype(a.dtype)
    rows = csr_rows(row_offsets)
    cols = column_indices.long()
    aa = a.to(acc_dtype)
    bb = b.to(acc_dtype)
    out = torch.empty(cols.numel(), dtype=acc_dtype, device=a.device)
    step = _chunk(a.shape[1])
    for start in range(0, cols.numel(), step):
        sl = slice(start, start + step)
        out[sl] = (aa[rows[sl]] * bb[cols[sl]]).sum(-1)
    out[csr_padding_mask(row_offsets, column_indices)] = 0
    return out.to(a.dtype)
