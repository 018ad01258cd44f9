"""Pruning criteria: a score per weight element, higher = more important.

- ``magnitude``: ``|W|`` (Han et al., "Learning both Weights and Connections", NeurIPS 2015;
  the one-shot form of Zhu & Gupta 2017's gradual magnitude pruning, GMP).
- ``wanda``: ``|W_ij| * ||X_j||_2`` (Sun et al., "A Simple and Effective Pruning Approach for
  Large Language Models", ICLR 2024, eq. 1), where ``||X_j||_2`` is the L2 norm of input
  feature ``j`` over all calibration tokens; for unstructured sparsity the scores are compared
  per output row (the paper's section 3, "comparison group"), see :func:`rowwise_mask`.
- ``sparsegpt``: not a score but a reconstruction (Frantar & Alistarh, ICML 2023), in
  :mod:`prunekit.prune.sparsegpt`.

Methods in :data:`CALIBRATED` need input activations from calibration data, hence a model's
forward pass (:mod:`prunekit.prune.calibration`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import PatternError
from .patterns import Pattern, Unstructured

__all__ = ["CRITERIA", "CALIBRATED", "METHODS", "magnitude", "wanda", "rowwise_mask", "method_mask", "check_method"]

Criterion = Callable[[torch.Tensor], torch.Tensor]


def magnitude(weight: torch.Tensor) -> torch.Tensor:
    """Score ``|W|`` in float32; ``weight: (out_features, in_features)`` -> same shape."""
    return weight.detach().float().abs()


def wanda(weight: torch.Tensor, input_norm: torch.Tensor) -> torch.Tensor:
    """Wanda score ``|W_ij| * ||X_j||_2`` (Sun et al. 2023, eq. 1), float32.

    Args:
        weight: ``(out_features, in_features)``.
        input_norm: ``(in_features,)``, the L2 norm of each input feature over all calibration
            tokens, ``sqrt(sum_t x[t, j]^2)``.

    Raises:
        PatternError: ``input_norm`` does not have ``in_features`` entries.
    """
    if input_norm.shape != (weight.shape[1],):
        raise PatternError(f"wanda: input norms of shape {tuple(input_norm.shape)} for a weight {tuple(weight.shape)}")
    return weight.detach().float().abs() * input_norm.float().to(weight.device)[None, :]


def rowwise_mask(scores: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Unstructured keep-mask comparing scores within each output row (Wanda's comparison group).

    Row ``i`` of ``scores: (out_features, in_features)`` prunes its lowest
    ``round(s * (i + 1) * K) - round(s * i * K)`` scores (ties by index), so every row is at the
    target sparsity up to one element and the tensor holds exactly ``round(s * numel)`` zeros,
    like :class:`prunekit.prune.patterns.Unstructured`. Returns bool, True = kept.
    """
    rows, cols = scores.shape
    order = torch.argsort(scores.float(), dim=1, stable=True)
    bounds = [round(sparsity * i * cols) for i in range(rows + 1)]
    counts = torch.tensor([bounds[i + 1] - bounds[i] for i in range(rows)], device=scores.device)
    ranks = torch.arange(cols, device=scores.device)[None, :]
    prune_sorted = ranks < counts[:, None]
    keep = torch.ones_like(scores, dtype=torch.bool)
    keep.scatter_(1, order, ~prune_sorted)
    return keep


def method_mask(scores: torch.Tensor, pattern: Pattern, sparsity: float, rowwise: bool) -> torch.Tensor:
    """Keep-mask for ``scores`` under ``pattern``; unstructured masks compare per row when ``rowwise``."""
    if rowwise and isinstance(pattern, Unstructured):
        return rowwise_mask(scores, sparsity)
    return pattern.mask(scores, sparsity)


CRITERIA: dict[str, Criterion] = {"magnitude": magnitude}
CALIBRATED = ("wanda", "sparsegpt")
METHODS = ("magnitude", *CALIBRATED)


def check_method(name: str) -> str:
    """Validate a pruning method name and return it.

    Raises:
        PatternError: unknown method.
    """
    if name not in METHODS:
        raise PatternError(f"unknown pruning method {name!r}; known: {', '.join(METHODS)}")
    return name


def get_criterion(name: str) -> Criterion:
    """Look a weight-only criterion up by name (``magnitude``).

    Raises:
        PatternError: unknown method, or one that needs calibration data (Wanda, SparseGPT).
    """
    check_method(name)
    if name in CALIBRATED:
        raise PatternError(f"method {name!r} needs calibration activations: use a Hugging Face model directory")
    return CRITERIA[name]
