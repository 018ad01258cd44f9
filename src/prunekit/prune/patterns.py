"""Sparsity patterns: which zeros a pruned weight may have.

A pattern turns a score matrix (higher = more important) into a boolean keep-mask
at a requested sparsity, and checks that a mask obeys it. Weights are viewed as
2-D ``(out_features, in_features)``; conv weights are flattened to
``(out_channels, in_channels * prod(kernel))`` by the caller.

- ``unstructured``: any element may be zero (Han et al. 2015; magnitude pruning).
- ``block:RxC``: zeros come in whole R x C tiles (block sparsity as consumed by
  BSR kernels; PopSparse, Graphcore 2023).
- ``N:M``: at most N non-zeros in every group of M consecutive elements along the
  input dimension (NVIDIA Ampere 2:4 sparsity; Mishra et al. 2021).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from ..errors import PatternError

__all__ = ["Pattern", "Unstructured", "Block", "NM", "parse_pattern"]


class Pattern:
    """Base class. Subclasses are frozen dataclasses; ``str(pattern)`` round-trips through :func:`parse_pattern`."""

    def check_sparsity(self, sparsity: float | None) -> float:
        """Return the sparsity this pattern will reach for a requested one.

        Raises:
            PatternError: sparsity outside [0, 1), or inconsistent with an N:M pattern.
        """
        if sparsity is None:
            raise PatternError(f"pattern {self} needs --sparsity (a fraction of zeros in [0, 1))")
        if not (0.0 <= float(sparsity) < 1.0) or math.isnan(float(sparsity)):
            raise PatternError(f"sparsity must be in [0, 1), got {sparsity}")
        return float(sparsity)

    def unfit_reason(self, shape: tuple[int, int]) -> str | None:
        """Why a 2-D ``(out_features, in_features)`` shape cannot take this pattern, or None if it can."""
        return None

    def mask(self, scores: torch.Tensor, sparsity: float) -> torch.Tensor:
        """Keep-mask of ``scores: (out_features, in_features)``; bool, True = kept, same shape."""
        raise NotImplementedError

    def is_valid(self, mask: torch.Tensor) -> bool:
        """True if the bool keep-mask ``(out_features, in_features)`` obeys the pattern."""
        raise NotImplementedError


def _keep_topk(flat_scores: torch.Tensor, n_prune: int) -> torch.Tensor:
    """Bool mask over a 1-D score vector keeping all but the ``n_prune`` lowest scores (ties by index)."""
    keep = torch.ones_like(flat_scores, dtype=torch.bool)
    if n_prune > 0:
        order = torch.argsort(flat_scores, stable=True)
        keep[order[:n_prune]] = False
    return keep


@dataclass(frozen=True)
class Unstructured(Pattern):
    """Element-wise sparsity: exactly ``round(sparsity * numel)`` zeros per tensor."""

    def __str__(self) -> str:
        return "unstructured"

    def mask(self, scores: torch.Tensor, sparsity: float) -> torch.Tensor:
        n_prune = round(sparsity * scores.numel())
        return _keep_topk(scores.reshape(-1).float(), n_prune).reshape(scores.shape)

    def is_valid(self, mask: torch.Tensor) -> bool:
        return True


@dataclass(frozen=True)
class Block(Pattern):
    """Tile sparsity: every ``rows x cols`` block is all zero or kept whole; block score = sum of scores."""

    rows: int
    cols: int

    def __str__(self) -> str:
        return f"block:{self.rows}x{self.cols}"

    def unfit_reason(self, shape: tuple[int, int]) -> str | None:
        m, k = shape
        if m % self.rows or k % self.cols:
            return f"shape {m}x{k} is not a multiple of block {self.rows}x{self.cols}"
        return None

    def _blocks(self, t: torch.Tensor) -> torch.Tensor:
        m, k = t.shape
        return t.reshape(m // self.rows, self.rows, k // self.cols, self.cols)

    def mask(self, scores: torch.Tensor, sparsity: float) -> torch.Tensor:
        block_scores = self._blocks(scores.float()).sum(dim=(1, 3))
        n_prune = round(sparsity * block_scores.numel())
        keep = _keep_topk(block_scores.reshape(-1), n_prune).reshape(block_scores.shape)
        return keep[:, None, :, None].expand(-1, self.rows, -1, self.cols).reshape(scores.shape)

    def is_valid(self, mask: torch.Tensor) -> bool:
        if self.unfit_reason(tuple(mask.shape)) is not None:
            return False
        counts = self._blocks(mask).sum(dim=(1, 3))
        return bool(((counts == 0) | (counts == self.rows * self.cols)).all())


@dataclass(frozen=True)
class NM(Pattern):
    """N:M sparsity along the input dimension: at most ``n`` non-zeros in each group of ``m``."""

    n: int
    m: int

    def __str__(self) -> str:
        return f"{self.n}:{self.m}"

    def check_sparsity(self, sparsity: float | None) -> float:
        implied = 1.0 - self.n / self.m
        if sparsity is not None and abs(float(sparsity) - implied) > 1e-9:
            raise PatternError(f"pattern {self} implies sparsity {implied:g}, but --sparsity {sparsity} was given")
        return implied

    def unfit_reason(self, shape: tuple[int, int]) -> str | None:
        if shape[1] % self.m:
            return f"in_features {shape[1]} is not a multiple of M={self.m}"
        return None

    def mask(self, scores: torch.Tensor, sparsity: float) -> torch.Tensor:
        out_features, in_features = scores.shape
        groups = scores.float().reshape(out_features, in_features // self.m, self.m)
        # Stable sort: among equal scores the earlier element is kept, so results are deterministic.
        order = torch.argsort(groups, dim=-1, descending=True, stable=True)
        keep = torch.zeros_like(groups, dtype=torch.bool)
        keep.scatter_(-1, order[..., : self.n], True)
        return keep.reshape(scores.shape)

    def is_valid(self, mask: torch.Tensor) -> bool:
        if self.unfit_reason(tuple(mask.shape)) is not None:
            return False
        counts = mask.reshape(mask.shape[0], -1, self.m).sum(dim=-1)
        return bool((counts <= self.n).all())


_BLOCK_RE = re.compile(r"^block:(\d+)x(\d+)$")
_NM_RE = re.compile(r"^(\d+):(\d+)$")


def parse_pattern(text: str) -> Pattern:
    """Parse ``unstructured``, ``block:RxC`` or ``N:M`` into a :class:`Pattern`.

    Raises:
        PatternError: unknown syntax, zero sizes, or N > M.
    """
    spec = text.strip().lower()
    if spec == "unstructured":
        return Unstructured()
    if match := _BLOCK_RE.match(spec):
        rows, cols = int(match[1]), int(match[2])
        if rows < 1 or cols < 1:
            raise PatternError(f"block sizes must be positive, got {text!r}")
        return Block(rows, cols)
    if match := _NM_RE.match(spec):
        n, m = int(match[1]), int(match[2])
        if m < 1 or n < 1:
            raise PatternError(f"N and M must be positive in {text!r}")
        if n > m:
            raise PatternError(f"N:M pattern {text!r} has N > M")
        if m > 256:
            raise PatternError(f"N:M pattern {text!r}: M must be at most 256")
        return NM(n, m)
    raise PatternError(
        f"unknown pattern {text!r}: use 'unstructured', 'block:RxC' (e.g. block:32x32) or 'N:M' (e.g. 2:4)"
    )
