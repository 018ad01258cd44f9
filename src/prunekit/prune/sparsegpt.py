"""SparseGPT: one-shot pruning with layer-wise OBS reconstruction.

Frantar & Alistarh, "SparseGPT: Massive Language Models Can Be Accurately Pruned in One-Shot",
ICML 2023 (Algorithm 1). For a linear layer ``y = x W^T`` and calibration inputs
``X: (tokens, in_features)``, the layer-wise objective ``||X W^T - X Ŵ^T||^2`` has the Hessian
``H = X^T X`` (shared by every output row). Columns are processed left to right; when a weight
is pruned, the Optimal Brain Surgeon update spreads its error over the columns to its right,
using the rows of the upper Cholesky factor of ``H^-1`` (section 3.2, "Hessian synchronization").
Updates are applied lazily in blocks of :data:`BLOCK_SIZE` columns (section 3.3).

Mask selection (section 3.4, "adaptive mask selection"): for unstructured sparsity, the mask of
each column block is chosen from the OBS saliency ``w^2 / [H^-1]_cc^2`` of the already-updated
weights; for N:M, the mask of each group of M columns when the loop reaches it. Block patterns
(``block:RxC``) choose whole tiles up front from the saliency summed over each tile, then
reconstruct with that fixed mask.
"""

from __future__ import annotations

import torch

from ..errors import PatternError
from .patterns import NM, Block, Pattern, Unstructured

__all__ = ["BLOCK_SIZE", "DAMP_FRACTION", "sparsegpt_prune", "inverse_hessian_factor"]

BLOCK_SIZE = 128  # lazy-update block width, SparseGPT section 3.3 (B = 128)
DAMP_FRACTION = 0.01  # dampening lambda = 1% of the mean diagonal of H, SparseGPT section 4 / reference code


def inverse_hessian_factor(hessian: torch.Tensor, damp: float = DAMP_FRACTION) -> torch.Tensor:
    """Upper Cholesky factor ``U`` of ``(H + lambda I)^-1`` (``U^T U = (H + lambda I)^-1``).

    Args:
        hessian: ``(in_features, in_features)``, symmetric positive semi-definite (``X^T X``).
        damp: ``lambda`` as a fraction of ``mean(diag(H))``; inputs whose diagonal is 0 (never
            active) get a diagonal of 1 first, as in the reference implementation.

    Raises:
        PatternError: H is not finite, or not positive definite even after dampening.
    """
    h = hessian.clone()
    if not torch.isfinite(h).all():
        raise PatternError("sparsegpt: the calibration Hessian has inf/NaN entries (activations overflowed)")
    diag = torch.arange(h.shape[0], device=h.device)
    dead = h[diag, diag] == 0
    h[diag[dead], diag[dead]] = 1.0
    h[diag, diag] += damp * h[diag, diag].mean()
    try:
        inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
        return torch.linalg.cholesky(inverse, upper=True)
    except torch.linalg.LinAlgError:
        raise PatternError(
            "sparsegpt: the calibration Hessian is not positive definite after dampening; "
            "use more calibration samples or a larger dampening"
        ) from None


def _lowest(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Bool mask (same shape) of the ``count`` lowest entries of ``scores`` (ties by index)."""
    pruned = torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device)
    if count > 0:
        pruned[torch.argsort(scores.reshape(-1), stable=True)[:count]] = True
    return pruned.reshape(scores.shape)


def sparsegpt_prune(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    pattern: Pattern,
    sparsity: float,
    block_size: int = BLOCK_SIZE,
    damp: float = DAMP_FRACTION,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prune ``weight`` to ``pattern`` and reconstruct the kept weights (SparseGPT, Algorithm 1).

    Args:
        weight: ``(out_features, in_features)``, any float dtype (computed in float32, or float64
            when given float64).
        hessian: ``(in_features, in_features)``, ``X^T X`` over calibration tokens (any positive
            scale: dampening is relative).
        pattern: :class:`Unstructured`, :class:`NM` or :class:`Block`.
        sparsity: fraction of zeros (implied by N:M). Unstructured and block masks prune exactly
            ``round(sparsity * count)`` elements/tiles, like :mod:`prunekit.prune.patterns`.
        block_size: lazy-update block width (rounded up to a multiple of M for N:M).
        damp: dampening fraction (see :func:`inverse_hessian_factor`).
        mask: optional fixed bool keep-mask ``(out_features, in_features)`` to reconstruct for
            (then ``pattern`` and ``sparsity`` only label the result).

    Returns:
        ``(pruned, keep)``: the reconstructed weight (same shape and dtype as ``weight``, exactly
        zero where pruned) and the bool keep-mask (True = kept).

    Raises:
        PatternError: shape does not fit the pattern, unsupported pattern, bad Hessian.
    """
    rows, cols = weight.shape
    if hessian.shape != (cols, cols):
        raise PatternError(f"sparsegpt: Hessian {tuple(hessian.shape)} does not match weight {tuple(weight.shape)}")
    reason = pattern.unfit_reason((rows, cols))
    if reason is not None:
        raise PatternError(reason)
    if not isinstance(pattern, Unstructured | NM | Block):
        raise PatternError(f"sparsegpt does not support pattern {pattern}")
    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    w = weight.detach().to(dtype).clone()
    u = inverse_hessian_factor(hessian.detach().to(device=w.device, dtype=dtype), damp)
    u_diag = torch.diagonal(u)

    pruned_all = torch.zeros(rows, cols, dtype=torch.bool, device=w.device)
    fixed = None
    if mask is not None:
        fixed = ~mask.to(device=w.device, dtype=torch.bool)
    elif isinstance(pattern, Block):
        fixed = ~pattern.mask(w**2 / u_diag[None, :] ** 2, sparsity)
    if isinstance(pattern, NM):
        block_size = -(-block_size // pattern.m) * pattern.m
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        w1 = w[:, i1:i2].clone()
        q1 = torch.zeros_like(w1)
        err1 = torch.zeros_like(w1)
        u1 = u[i1:i2, i1:i2]
        d1 = torch.diagonal(u1)
        if fixed is not None:
            pruned1 = fixed[:, i1:i2].clone()
        elif isinstance(pattern, Unstructured):
            count = round(sparsity * rows * i2) - round(sparsity * rows * i1)
            pruned1 = _lowest(w1**2 / d1[None, :] ** 2, count)
        else:
            pruned1 = torch.zeros_like(w1, dtype=torch.bool)
        for i in range(i2 - i1):
            if fixed is None and isinstance(pattern, NM) and i % pattern.m == 0:
                saliency = w1[:, i : i + pattern.m] ** 2 / d1[None, i : i + pattern.m] ** 2
                order = torch.argsort(saliency, dim=1, stable=True)[:, : pattern.m - pattern.n]
                pruned1[:, i : i + pattern.m].scatter_(1, order, True)
            col = w1[:, i]
            q = torch.where(pruned1[:, i], torch.zeros_like(col), col)
            q1[:, i] = q
            err = (col - q) / u1[i, i]
            w1[:, i:] -= err[:, None] * u1[i, i:][None, :]
            err1[:, i] = err
        w[:, i1:i2] = q1
        w[:, i2:] -= err1 @ u[i1:i2, i2:]
        pruned_all[:, i1:i2] = pruned1
    keep = ~pruned_all
    out = (w * keep.to(dtype)).to(weight.dtype)
    return out, keep
