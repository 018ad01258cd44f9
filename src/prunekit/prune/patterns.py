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
- ``ks:a,b,c,d``: Kronecker-sparse support ``I_a ⊗ 1_{b×c} ⊗ I_d`` of shape ``(a*b*d, a*c*d)``, density
  ``1/(a*d)`` (Gonon et al. 2024, arXiv 2405.15013, section 2); ``ks:a1,b1,c1,d1/a2,b2,c2,d2/...`` is a chain
  ``W = K_1 @ K_2 @ ...`` of such factors, reached by factorisation (``prunekit.prune.kronecker``), not by a mask.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from ..errors import FormatError, PatternError
from ..formats.ks import format_patterns, ks_shape, ks_support, parse_patterns

__all__ = ["Pattern", "Unstructured", "Block", "NM", "KroneckerSparse", "KroneckerChain", "parse_pattern"]


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


@dataclass(frozen=True)
class KroneckerSparse(Pattern):
    """One Kronecker-sparse factor (Gonon et al. 2024, arXiv 2405.15013, section 2).

    Support ``I_a ⊗ 1_{b×c} ⊗ I_d``: shape ``(a*b*d, a*c*d)``, ``a*b*c*d`` kept entries, sparsity ``1 - 1/(a*d)``.
    The mask is the support itself (a projection: scores only matter inside it, where everything is kept).
    """

    a: int
    b: int
    c: int
    d: int

    def __str__(self) -> str:
        return f"ks:{self.a},{self.b},{self.c},{self.d}"

    @property
    def quad(self) -> tuple[int, int, int, int]:
        return (self.a, self.b, self.c, self.d)

    @property
    def shape(self) -> tuple[int, int]:
        """Dense shape ``(a*b*d, a*c*d)``."""
        return ks_shape(self.quad)

    @property
    def implied_sparsity(self) -> float:
        return 1.0 - 1.0 / (self.a * self.d)

    def check_sparsity(self, sparsity: float | None) -> float:
        implied = self.implied_sparsity
        if sparsity is not None and abs(float(sparsity) - implied) > 1e-9:
            raise PatternError(
                f"pattern {self} implies sparsity 1 - 1/(a*d) = {implied:g}, but --sparsity {sparsity} was given"
            )
        return implied

    def unfit_reason(self, shape: tuple[int, int]) -> str | None:
        if tuple(shape) != self.shape:
            return f"shape {shape[0]}x{shape[1]} is not (a*b*d)x(a*c*d) = {self.shape[0]}x{self.shape[1]} for {self}"
        return None

    def support(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Bool ``(a*b*d, a*c*d)`` support (True = may be non-zero)."""
        return ks_support(self.quad, device)

    def mask(self, scores: torch.Tensor, sparsity: float) -> torch.Tensor:
        reason = self.unfit_reason(tuple(scores.shape))
        if reason is not None:
            raise PatternError(reason)
        return self.support(scores.device)

    def is_valid(self, mask: torch.Tensor) -> bool:
        if mask.dim() != 2 or self.unfit_reason(tuple(mask.shape)) is not None:
            return False
        return not bool((mask.bool() & ~self.support(mask.device)).any())


@dataclass(frozen=True)
class KroneckerChain(Pattern):
    """A product ``W = K_1 @ K_2 @ ... @ K_L`` of Kronecker-sparse factors (Gonon et al. 2024, section 2).

    ``ks:p1/p2/.../pL`` lists ``K_1`` first (``K_L`` is applied first to an input). Shapes compose:
    ``a_i*c_i*d_i == a_{i+1}*b_{i+1}*d_{i+1}``; the chain's shape is ``(rows of K_1, columns of K_L)``.
    The product is not a masked weight: it is reached by :func:`prunekit.prune.kronecker.factorize`, so
    :meth:`mask` raises. Its sparsity is the fraction of the dense parameters that the factors do not store.
    """

    factors: tuple[KroneckerSparse, ...]

    def __str__(self) -> str:
        return "ks:" + format_patterns([f.quad for f in self.factors])

    @property
    def shape(self) -> tuple[int, int]:
        return self.factors[0].shape[0], self.factors[-1].shape[1]

    @property
    def nparams(self) -> int:
        """Entries the factors store: ``sum(a*b*c*d)``."""
        return sum(f.a * f.b * f.c * f.d for f in self.factors)

    @property
    def implied_sparsity(self) -> float:
        rows, cols = self.shape
        return max(0.0, 1.0 - self.nparams / (rows * cols))

    def check_sparsity(self, sparsity: float | None) -> float:
        implied = self.implied_sparsity
        if sparsity is not None and abs(float(sparsity) - implied) > 1e-9:
            raise PatternError(
                f"chain {self} stores {self.nparams} parameters (sparsity {implied:g} of its dense shape), "
                f"but --sparsity {sparsity} was given"
            )
        return implied

    def unfit_reason(self, shape: tuple[int, int]) -> str | None:
        if tuple(shape) != self.shape:
            return f"shape {shape[0]}x{shape[1]} is not the chain's {self.shape[0]}x{self.shape[1]} for {self}"
        return None

    def support(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Bool support of the product (boolean product of the factors' supports)."""
        support = self.factors[0].support(device).float()
        for f in self.factors[1:]:
            support = ((support @ f.support(device).float()) > 0).float()
        return support > 0

    def mask(self, scores: torch.Tensor, sparsity: float) -> torch.Tensor:
        raise PatternError(
            f"{self} is a chain of {len(self.factors)} Kronecker-sparse factors, not a mask: factorize the weights "
            "with `prunekit ks factorize` (a single factor ks:a,b,c,d can be pruned)"
        )

    def is_valid(self, mask: torch.Tensor) -> bool:
        if mask.dim() != 2 or self.unfit_reason(tuple(mask.shape)) is not None:
            return False
        return not bool((mask.bool() & ~self.support(mask.device)).any())


def parse_ks(text: str) -> KroneckerSparse | KroneckerChain:
    """``ks:a,b,c,d`` -> :class:`KroneckerSparse`; ``ks:a,b,c,d/a,b,c,d/...`` -> :class:`KroneckerChain`.

    Raises:
        PatternError: malformed sizes, a non-positive size, or factors whose shapes do not compose.
    """
    body = text.strip().lower().removeprefix("ks:")
    try:
        quads = parse_patterns(body)
    except FormatError as exc:
        raise PatternError(f"{exc}; use ks:a,b,c,d or a chain ks:a,b,c,d/a,b,c,d") from None
    factors = tuple(KroneckerSparse(*q) for q in quads)
    return factors[0] if len(factors) == 1 else KroneckerChain(factors)


_BLOCK_RE = re.compile(r"^block:(\d+)x(\d+)$")
_NM_RE = re.compile(r"^(\d+):(\d+)$")


def parse_pattern(text: str) -> Pattern:
    """Parse ``unstructured``, ``block:RxC``, ``N:M``, ``ks:a,b,c,d`` or ``ks:a,b,c,d/a,b,c,d/...``.

    Raises:
        PatternError: unknown syntax, zero sizes, N > M, or a Kronecker-sparse chain whose shapes do not compose.
    """
    spec = text.strip().lower()
    if spec == "unstructured":
        return Unstructured()
    if spec.startswith("ks:"):
        return parse_ks(spec)
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
        f"unknown pattern {text!r}: use 'unstructured', 'block:RxC' (e.g. block:32x32), 'N:M' (e.g. 2:4) "
        "or 'ks:a,b,c,d' (Kronecker-sparse; a chain ks:a,b,c,d/a,b,c,d)"
    )
