"""Factorising a dense (or pruned) weight into a chain of Kronecker-sparse factors.

A chain ``W ≈ K_1 @ K_2 @ ... @ K_L`` of Kronecker-sparse factors with fixed patterns (Gonon et al. 2024,
"Fast inference with Kronecker-sparse matrices", arXiv 2405.15013, section 2; ``prunekit.prune.patterns``) is
fitted in two stages:

1. **Hierarchical initialisation** (the two-factor fixed-support method of Zheng, Riccietti & Gribonval,
   "Efficient identification of butterfly sparse matrix factorizations", SIAM J. Math. Data Sci. 2023, and
   Le et al., "Fast learning of fast transforms with guarantees", ICASSP 2022). For ``W ≈ X @ Y`` with fixed
   supports, the inner indices ``k`` fall in classes with the same column support of ``X`` and row support of
   ``Y``; each class ``P`` only touches the rectangle ``R_P x C_P`` of ``W``. When the rectangles of different
   classes are disjoint (always the case for two KS factors: rows are fixed by ``(alpha_1, delta_1)`` and
   columns by ``(alpha_2, delta_2)``), the problem splits into independent truncated SVDs of rank ``|P|``: the
   optimum, and an exact recovery when ``W`` is such a product. A chain is peeled left to right:
   ``W ≈ K_1 @ (support of K_2 ... K_L)``, then the right part is factorised the same way.
2. **Alternating least squares** on the supports: each factor in turn is the exact least-squares solution with
   the others fixed (conjugate gradients on the normal equations restricted to the support, started from the
   current factor, so the error never increases in exact arithmetic).

The relative error ``||W - K_1 ... K_L||_F / ||W||_F`` is reported after the initialisation and each sweep.
Dense float64 algebra on the CPU: the cost per sweep is a few products of the layer's size, meant for layers up to
a few thousand wide.

:func:`factorize_checkpoint` writes a checkpoint of the same kind whose factorised weights hold the dense product
``K_1 @ ... @ K_L`` (so the checkpoint is still an ordinary model), with the pattern, the parameter sparsity and the
relative error per tensor in the sidecar ``prunekit.json``. ``convert``/``export`` recover the factors from the
product with stage 1 (exact for such products, checked against a tolerance) and store them in the ``ks`` format.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import __version__
from ..errors import PatternError
from ..formats.ks import blocks_to_dense, dense_to_blocks, ks_support
from ..io import atomic_path, check_output, open_checkpoint, sidecar_path
from ..io.checkpoint import HF_PICKLE, HF_SAFETENSORS
from ..io.safetensors_io import StreamingWriter
from .patterns import KroneckerChain, KroneckerSparse, parse_pattern
from .select import select_tensors

__all__ = [
    "KSFactorization",
    "FactorizeResult",
    "chain_product",
    "factorize",
    "factorize_checkpoint",
    "recover_factors",
    "RECOVERY_TOLERANCE",
    "two_factor_fit",
]

log = logging.getLogger(__name__)
Progress = Callable[[int, int, str], None]

DEFAULT_SWEEPS = 10  # ALS sweeps over all factors
DEFAULT_CG_STEPS = 30  # conjugate-gradient steps per factor update
METHOD = "ks-factorize"
# Largest relative error at which factors recovered from a stored product count as exact, per stored dtype
# (a few units of the dtype's rounding of the product; float32 eps 1.2e-7, float16 9.8e-4, bfloat16 7.8e-3).
RECOVERY_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}


def _factors_of(pattern: str | KroneckerSparse | KroneckerChain) -> tuple[KroneckerSparse, ...]:
    pat = parse_pattern(pattern) if isinstance(pattern, str) else pattern
    if isinstance(pat, KroneckerSparse):
        return (pat,)
    if isinstance(pat, KroneckerChain):
        return pat.factors
    raise PatternError(f"pattern {pat} is not Kronecker-sparse; use ks:a,b,c,d or ks:a,b,c,d/a,b,c,d/...")


@dataclass
class KSFactorization:
    """Result of :func:`factorize`.

    Attributes:
        pattern: the chain, ``ks:...``.
        factors: ``(a_i, d_i, b_i, c_i)`` blocks per factor, ``K_1`` first, in the weight's dtype.
        rel_error: ``||W - K_1 ... K_L||_F / ||W||_F`` of the returned factors (float64 arithmetic).
        history: relative error after the initialisation, then after each ALS sweep (float64 factors).
        exact_init: True when every hierarchical split had disjoint rectangles (its SVD step is optimal).
    """

    pattern: str
    factors: list[torch.Tensor]
    rel_error: float
    history: list[float] = field(default_factory=list)
    exact_init: bool = True


def chain_product(factors: list[torch.Tensor], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Dense ``K_1 @ ... @ K_L`` of factor blocks ``[(a_i, d_i, b_i, c_i), ...]``, computed in ``dtype``."""
    product = blocks_to_dense(factors[0].to(dtype))
    for blk in factors[1:]:
        product = product @ blocks_to_dense(blk.to(dtype))
    return product


def _product_support(factors: tuple[KroneckerSparse, ...]) -> torch.Tensor:
    support = factors[0].support().double()
    for f in factors[1:]:
        support = ((support @ f.support().double()) > 0).double()
    return support > 0


def two_factor_fit(
    target: torch.Tensor, left_support: torch.Tensor, right_support: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Best ``X @ Y`` to ``target`` with ``X`` on ``left_support`` and ``Y`` on ``right_support`` (Zheng et al. 2023).

    Args:
        target: ``(M, K)`` float64.
        left_support: bool ``(M, r)``; right_support: bool ``(r, K)``.

    Returns:
        ``X (M, r)``, ``Y (r, K)`` float64 on their supports, and whether the classes' rectangles were disjoint
        (then the result is the least-squares optimum; otherwise each class is fitted to its rectangle alone, a
        starting point for :func:`factorize`'s ALS).
    """
    m, r = left_support.shape
    k = right_support.shape[1]
    keys = torch.cat([left_support.t(), right_support], dim=1)
    classes, inverse = torch.unique(keys, dim=0, return_inverse=True)
    x = torch.zeros(m, r, dtype=torch.float64)
    y = torch.zeros(r, k, dtype=torch.float64)
    cover = torch.zeros(m, k, dtype=torch.int32)
    for cls in range(classes.shape[0]):
        members = torch.nonzero(inverse == cls, as_tuple=True)[0]
        rows = torch.nonzero(classes[cls, :m], as_tuple=True)[0]
        cols = torch.nonzero(classes[cls, m:], as_tuple=True)[0]
        if rows.numel() == 0 or cols.numel() == 0:
            continue
        cover[rows[:, None], cols[None, :]] += 1
        block = target[rows[:, None], cols[None, :]]
        u, s, vh = torch.linalg.svd(block, full_matrices=False)
        q = min(members.numel(), s.numel())
        root = s[:q].sqrt()
        x[rows[:, None], members[None, :q]] = u[:, :q] * root
        y[members[:q, None], cols[None, :]] = root[:, None] * vh[:q]
    return x, y, bool((cover <= 1).all())


def _hierarchical(target: torch.Tensor, factors: tuple[KroneckerSparse, ...]) -> tuple[list[torch.Tensor], bool]:
    blocks, exact, rest = [], True, target
    for i, f in enumerate(factors[:-1]):
        x, y, disjoint = two_factor_fit(rest, f.support(), _product_support(factors[i + 1 :]))
        exact &= disjoint
        blocks.append(dense_to_blocks(x, f.quad))
        rest = y
    blocks.append(dense_to_blocks(rest, factors[-1].quad))
    return blocks, exact


def _cg_update(
    current: torch.Tensor,
    support: torch.Tensor,
    left_gram: torch.Tensor | None,
    right_gram: torch.Tensor | None,
    rhs: torch.Tensor,
    steps: int,
) -> torch.Tensor:
    """Conjugate gradients on ``P_S(Lg F Rg) = P_S(rhs)`` from ``current`` (dense, zero off the support)."""
    s = support.to(torch.float64)

    def apply(f: torch.Tensor) -> torch.Tensor:
        out = f if left_gram is None else left_gram @ f
        out = out if right_gram is None else out @ right_gram
        return out * s

    f = current.clone()
    resid = rhs * s - apply(f)
    direction = resid.clone()
    rr = float((resid * resid).sum())
    scale = float((rhs * rhs).sum()) or 1.0
    for _ in range(steps):
        if rr <= 1e-28 * scale:
            break
        a_dir = apply(direction)
        denom = float((direction * a_dir).sum())
        if denom <= 0.0:
            break
        alpha = rr / denom
        f = f + alpha * direction
        resid = resid - alpha * a_dir
        rr_new = float((resid * resid).sum())
        direction = resid + (rr_new / rr) * direction
        rr = rr_new
    return f


def _rel_error(target: torch.Tensor, blocks: list[torch.Tensor], norm: float) -> float:
    return float((target - chain_product(blocks)).norm()) / norm


def factorize(
    weight: torch.Tensor,
    pattern: str | KroneckerSparse | KroneckerChain,
    sweeps: int = DEFAULT_SWEEPS,
    cg_steps: int = DEFAULT_CG_STEPS,
    tol: float = 1e-12,
) -> KSFactorization:
    """Factorise ``weight`` into the Kronecker-sparse chain ``pattern`` (see the module docstring).

    Args:
        weight: ``(M, K)`` floating point (conv weights viewed as 2-D by the caller); ``(M, K)`` must be the chain's
            shape ``(a_1*b_1*d_1, a_L*c_L*d_L)``.
        pattern: ``ks:a,b,c,d`` (a projection: the masked weight, no iterations) or a chain ``ks:.../...``.
        sweeps: ALS sweeps after the hierarchical initialisation (0: initialisation only).
        cg_steps: conjugate-gradient steps per factor update.
        tol: stop when the relative error falls under ``tol`` or a sweep improves it by less than ``tol``.

    Returns:
        :class:`KSFactorization` (factors in ``weight.dtype``).

    Raises:
        PatternError: not a Kronecker-sparse pattern, a shape that does not fit, or a non-floating weight.
    """
    factors = _factors_of(pattern)
    label = "ks:" + "/".join(str(f).removeprefix("ks:") for f in factors)
    if weight.dim() != 2 or not weight.is_floating_point():
        raise PatternError(f"factorize needs a 2-D floating-point weight, got {tuple(weight.shape)} {weight.dtype}")
    shape = (factors[0].shape[0], factors[-1].shape[1])
    if tuple(weight.shape) != shape:
        raise PatternError(f"weight shape {tuple(weight.shape)} is not the shape {shape} of {label}")
    target = weight.detach().to("cpu", torch.float64)
    norm = float(target.norm()) or 1.0
    blocks, exact = _hierarchical(target, factors)
    history = [_rel_error(target, blocks, norm)]
    if len(factors) > 1:
        supports = [ks_support(f.quad) for f in factors]
        for _ in range(sweeps):
            if history[-1] < tol:
                break
            for i in range(len(factors)):
                left = chain_product(blocks[:i]) if i > 0 else None
                right = chain_product(blocks[i + 1 :]) if i < len(factors) - 1 else None
                rhs = target if left is None else left.t() @ target
                rhs = rhs if right is None else rhs @ right.t()
                left_gram = None if left is None else left.t() @ left
                right_gram = None if right is None else right @ right.t()
                dense = _cg_update(blocks_to_dense(blocks[i]), supports[i], left_gram, right_gram, rhs, cg_steps)
                blocks[i] = dense_to_blocks(dense, factors[i].quad)
            history.append(_rel_error(target, blocks, norm))
            if history[-2] - history[-1] < tol:
                break
    out = [b.to(weight.dtype) for b in blocks]
    return KSFactorization(label, out, _rel_error(target, out, norm), history, exact)


def recover_factors(product: torch.Tensor, pattern: str | KroneckerSparse | KroneckerChain) -> KSFactorization:
    """Factors of a stored product ``K_1 @ ... @ K_L`` (hierarchical step only; exact for such products).

    Raises:
        PatternError: as :func:`factorize`; also when the recovery error exceeds :data:`RECOVERY_TOLERANCE`
            for the product's dtype (the weight is not such a product).
    """
    result = factorize(product, pattern, sweeps=0)
    tolerance = RECOVERY_TOLERANCE.get(product.dtype, 1e-5)
    if result.rel_error > tolerance:
        raise PatternError(
            f"the weight is not a product of {result.pattern} factors (recovery error {result.rel_error:.2e} > "
            f"{tolerance:g}); run `prunekit ks factorize` on it first"
        )
    return result


@dataclass
class FactorizeResult:
    """What :func:`factorize_checkpoint` did: per tensor its relative error, and skipped tensors with the reason."""

    output: Path
    pattern: str
    errors: dict[str, float] = field(default_factory=dict)
    skipped: list[tuple[str, str]] = field(default_factory=list)


def factorize_checkpoint(
    source: str | Path,
    output: str | Path,
    pattern: str,
    sweeps: int = DEFAULT_SWEEPS,
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> FactorizeResult:
    """Factorise every selected weight of a checkpoint into the chain ``pattern``; write the same kind of checkpoint.

    Each factorised weight is replaced by its dense product ``K_1 @ ... @ K_L`` (same dtype and shape); the
    sidecar records per tensor ``pattern``, ``sparsity`` (fraction of the dense parameters the factors do not
    store), ``method = "ks-factorize"`` and ``rel_error``. ``convert``/``export`` store such tensors in ``ks``.

    Args:
        source: HF directory, ``.safetensors`` or torch state dict. output: same kind, written atomically.
        pattern: ``ks:a,b,c,d/...`` (one factor is allowed: a projection).
        sweeps: ALS sweeps per tensor. include / exclude: regexes as in ``prunekit prune``.
        progress: callback ``(done, total, name)``.

    Raises:
        PatternError: not a KS pattern, nothing fits it, or an explicitly included tensor does not fit.
        CheckpointError: unreadable source. OutputExistsError: output exists without ``overwrite``.
    """
    source, output = Path(source), Path(output)
    factors = _factors_of(pattern)
    chain = factors[0] if len(factors) == 1 else KroneckerChain(factors)
    check_output(output, overwrite, inputs=(source,))
    ckpt = open_checkpoint(source)
    names = ckpt.names()
    selection = select_tensors([(n, len(ckpt.shape(n)), ckpt.is_floating(n)) for n in names], include, exclude)
    result = FactorizeResult(output, str(chain))
    targets = []
    for name in selection.selected:
        shape = ckpt.shape(name)
        reason = chain.unfit_reason((shape[0], int(torch.Size(shape[1:]).numel())))
        if reason is None:
            targets.append(name)
        elif name in selection.explicit:
            raise PatternError(f"{name}: cannot take pattern {chain}: {reason}")
        else:
            result.skipped.append((name, reason))
    if not targets:
        why = f" ({result.skipped[0][0]}: {result.skipped[0][1]})" if result.skipped else ""
        raise PatternError(f"nothing to factorize in {source} with pattern {chain}: no selected tensor fits it{why}")
    target_set = set(targets)
    records: dict[str, dict] = {}

    def tensor(name: str) -> torch.Tensor:
        t = ckpt.get(name)
        if name not in target_set:
            return t
        fit = factorize(t.reshape(t.shape[0], -1), chain, sweeps=sweeps)
        result.errors[name] = fit.rel_error
        records[name] = {
            "shape": list(t.shape),
            "pattern": str(chain),
            "sparsity": chain.implied_sparsity,
            "target_sparsity": chain.implied_sparsity,
            "method": METHOD,
            "rel_error": fit.rel_error,
        }
        log.info("%s: %s relative error %.3e", name, chain, fit.rel_error)
        return chain_product(fit.factors, torch.float64).to(t.dtype).reshape(t.shape)

    def sidecar(path: Path) -> None:
        data = {
            "prunekit_version": __version__,
            "source": {"path": str(ckpt.path), "kind": ckpt.kind, "sha256": ckpt.source_sha256()},
            "tensors": records,
            "skipped": dict(result.skipped),
        }
        path.write_text(json.dumps(data, indent=2) + "\n")

    is_dir = ckpt.kind == "hf"
    with atomic_path(output, overwrite, directory=is_dir) as tmp:
        weights_path = tmp / (HF_SAFETENSORS if ckpt.is_safetensors else HF_PICKLE) if is_dir else tmp
        if is_dir:
            for rel in ckpt.config_files():
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ckpt.path / rel, tmp / rel)
        if ckpt.is_safetensors:
            with StreamingWriter(weights_path, {"format": "pt"}) as writer:
                for i, name in enumerate(names):
                    writer.write(name, tensor(name))
                    if progress:
                        progress(i + 1, len(names), name)
        else:
            state = {}
            for i, name in enumerate(names):
                state[name] = tensor(name)
                if progress:
                    progress(i + 1, len(names), name)
            torch.save(state, weights_path)
        if is_dir:
            sidecar(sidecar_path(tmp))
    if not is_dir:
        with atomic_path(sidecar_path(output), overwrite=True) as tmp_side:
            sidecar(tmp_side)
    return result
