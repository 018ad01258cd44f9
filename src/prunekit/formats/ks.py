"""Kronecker-sparse (KS) storage: a weight that is one KS factor, or a chain (product) of KS factors.

A KS factor with pattern ``(a, b, c, d)`` (Gonon et al. 2024, "Fast inference with Kronecker-sparse matrices",
arXiv 2405.15013, section 2) has support ``I_a ⊗ 1_{b×c} ⊗ I_d``: shape ``(a*b*d, a*c*d)``, ``a*b*c*d`` non-zeros,
density ``1 / (a*d)``. Row ``i = (alpha*b + beta)*d + delta`` and column ``j = (alpha*c + gamma)*d + delta`` hold
the entry ``blocks[alpha, delta, beta, gamma]``; every other entry is zero. The ``(a, d, b, c)`` block tensor is what
the kernels read ("kernel-ready"): for each ``(alpha, delta)`` one dense ``b x c`` tile.

A chain ``W = K_1 @ K_2 @ ... @ K_L`` (the order of ``ks:p1/p2/.../pL``: ``K_L`` is applied first to an input)
stores each factor's blocks. Components: ``blocks`` for ``K_1`` and ``blocks1`` ... ``blocks{L-1}`` for the others;
params: ``patterns`` = ``"a,b,c,d/a,b,c,d/..."`` (also for one factor) and, for one factor, ``a``, ``b``, ``c``,
``d``. ``decode`` returns the dense product (for one factor: the masked dense weight, exactly). ``encode`` takes a
weight on one factor's support; a chain cannot be encoded from its dense product (that is a factorisation:
``prunekit.prune.kronecker``), so :func:`encode_factors` builds it from the factors' blocks.

torch only: this package is copied into every exported package's ``runtime/``.
"""

from __future__ import annotations

import torch

from ..errors import FormatError
from .base import EncodedTensor, SparseFormat, dtype_name, register

__all__ = [
    "KS",
    "blocks_to_dense",
    "dense_to_blocks",
    "encode_factors",
    "factor_blocks",
    "format_patterns",
    "ks_shape",
    "ks_support",
    "parse_patterns",
]

Quad = tuple[int, int, int, int]


def ks_shape(pattern: Quad) -> tuple[int, int]:
    """Dense shape ``(a*b*d, a*c*d)`` of a KS factor with pattern ``(a, b, c, d)``."""
    a, b, c, d = pattern
    return a * b * d, a * c * d


def parse_patterns(text: str) -> list[Quad]:
    """``"a,b,c,d/a,b,c,d"`` -> ``[(a, b, c, d), ...]``; checks positivity and that consecutive shapes compose.

    Raises:
        FormatError: malformed text, a non-positive size, or factors whose shapes do not compose
            (``a_i*c_i*d_i`` must equal ``a_{i+1}*b_{i+1}*d_{i+1}``).
    """
    quads: list[Quad] = []
    for part in str(text).split("/"):
        fields = part.split(",")
        if len(fields) != 4 or not all(f.strip().isdigit() for f in fields):
            raise FormatError(f"bad Kronecker-sparse pattern {part!r} in {text!r}: expected four integers a,b,c,d")
        quad = tuple(int(f) for f in fields)
        if min(quad) < 1:
            raise FormatError(f"Kronecker-sparse pattern {part!r}: a, b, c, d must be positive")
        quads.append(quad)  # type: ignore[arg-type]
    for i in range(len(quads) - 1):
        inner_left, inner_right = ks_shape(quads[i])[1], ks_shape(quads[i + 1])[0]
        if inner_left != inner_right:
            raise FormatError(
                f"Kronecker-sparse chain {text!r}: factor {i + 1} has {inner_left} columns but factor {i + 2} has "
                f"{inner_right} rows (a*c*d of one must equal a*b*d of the next)"
            )
    return quads


def format_patterns(quads: list[Quad] | tuple[Quad, ...]) -> str:
    """``[(a, b, c, d), ...]`` -> ``"a,b,c,d/a,b,c,d"`` (inverse of :func:`parse_patterns`)."""
    return "/".join(",".join(str(v) for v in q) for q in quads)


def ks_support(pattern: Quad, device: torch.device | str | None = None) -> torch.Tensor:
    """Bool ``(a*b*d, a*c*d)`` support ``I_a ⊗ 1_{b×c} ⊗ I_d`` of a KS factor (True = may be non-zero)."""
    a, b, c, d = pattern
    ones = torch.ones(b, c, dtype=torch.float32, device=device)
    eye_a = torch.eye(a, device=device)
    eye_d = torch.eye(d, device=device)
    return torch.kron(torch.kron(eye_a, ones), eye_d) != 0


def dense_to_blocks(dense: torch.Tensor, pattern: Quad) -> torch.Tensor:
    """``(a, d, b, c)`` blocks of ``dense: (a*b*d, a*c*d)``; entries off the support are dropped (a projection).

    Raises:
        FormatError: the shape is not ``(a*b*d, a*c*d)``.
    """
    a, b, c, d = pattern
    if tuple(dense.shape) != ks_shape(pattern):
        raise FormatError(f"shape {tuple(dense.shape)} is not (a*b*d, a*c*d) = {ks_shape(pattern)} for ks {pattern}")
    five = dense.reshape(a, b, d, a, c, d)
    idx_a, idx_d = torch.arange(a, device=dense.device), torch.arange(d, device=dense.device)
    # five[alpha, :, delta, alpha, :, delta] for every (alpha, delta): (a, d, b, c)
    diag = five[idx_a[:, None], :, idx_d[None, :], idx_a[:, None], :, idx_d[None, :]]
    return diag.contiguous()


def blocks_to_dense(blocks: torch.Tensor) -> torch.Tensor:
    """Dense ``(a*b*d, a*c*d)`` matrix of a factor's ``blocks: (a, d, b, c)``; zeros off the support, exact."""
    a, d, b, c = blocks.shape
    dense = blocks.new_zeros(a, b, d, a, c, d)
    idx_a, idx_d = torch.arange(a, device=blocks.device), torch.arange(d, device=blocks.device)
    dense[idx_a[:, None], :, idx_d[None, :], idx_a[:, None], :, idx_d[None, :]] = blocks
    return dense.reshape(a * b * d, a * c * d)


def factor_blocks(encoded: EncodedTensor) -> list[torch.Tensor]:
    """The stored factors' ``(a, d, b, c)`` blocks, ``K_1`` first."""
    count = len(parse_patterns(str(encoded.params["patterns"])))
    return [encoded.components["blocks" if i == 0 else f"blocks{i}"] for i in range(count)]


def _params(quads: list[Quad]) -> dict[str, int | str]:
    params: dict[str, int | str] = {"patterns": format_patterns(quads)}
    if len(quads) == 1:
        params.update(zip("abcd", quads[0]))
    return params


def params_patterns(params: dict[str, int | str]) -> list[Quad] | None:
    """The chain in format params (``patterns``, or ``a``/``b``/``c``/``d`` for one factor); None when absent."""
    if "patterns" in params:
        return parse_patterns(str(params["patterns"]))
    if all(k in params for k in "abcd"):
        return parse_patterns(",".join(str(params[k]) for k in "abcd"))
    return None


def encode_factors(blocks: list[torch.Tensor], dtype: torch.dtype | None = None) -> EncodedTensor:
    """A ``ks`` :class:`EncodedTensor` from a chain's factor blocks ``[(a_1, d_1, b_1, c_1), ...]`` (``K_1`` first).

    Raises:
        FormatError: no factors, a factor that is not 4-D floating point, mixed dtypes, or shapes that do not compose.
    """
    if not blocks:
        raise FormatError("a Kronecker-sparse chain needs at least one factor")
    dtype = dtype or blocks[0].dtype
    quads = []
    for i, blk in enumerate(blocks):
        if blk.dim() != 4 or not blk.is_floating_point():
            raise FormatError(f"factor {i + 1}: blocks must be a floating (a, d, b, c) tensor, got {tuple(blk.shape)}")
        a, d, b, c = (int(s) for s in blk.shape)
        quads.append((a, b, c, d))
    parse_patterns(format_patterns(quads))  # shapes compose
    comps = {("blocks" if i == 0 else f"blocks{i}"): blk.to(dtype).contiguous() for i, blk in enumerate(blocks)}
    shape = (ks_shape(quads[0])[0], ks_shape(quads[-1])[1])
    return EncodedTensor("ks", shape, dtype_name(dtype), _params(quads), comps)


@register
class KS(SparseFormat):
    """Kronecker-sparse factors as ``(a, d, b, c)`` blocks; see the module docstring."""

    name = "ks"

    def unfit_reason(self, dense: torch.Tensor, params: dict[str, int | str]) -> str | None:
        try:
            quads = params_patterns(params)
        except FormatError as exc:
            return str(exc)
        if quads is None:
            return "needs a Kronecker-sparse pattern (params a, b, c, d or patterns; prune with --pattern ks:a,b,c,d)"
        if len(quads) > 1:
            return (
                f"a chain of {len(quads)} factors cannot be encoded from its dense product; "
                "factorize it (`prunekit ks factorize`) and store the factors"
            )
        if tuple(dense.shape) != ks_shape(quads[0]):
            return f"shape {tuple(dense.shape)} is not (a*b*d, a*c*d) = {ks_shape(quads[0])} for ks:{format_patterns(quads)}"
        if bool((dense[~ks_support(quads[0], dense.device)] != 0).any()):
            return f"the weight has non-zeros outside the support of ks:{format_patterns(quads)}"
        return None

    def encode(self, dense: torch.Tensor, params: dict[str, int | str]) -> EncodedTensor:
        self.check(dense, params)
        quads = params_patterns(params)
        assert quads is not None  # checked by unfit_reason
        return encode_factors([dense_to_blocks(dense, quads[0])], dense.dtype)

    def decode(self, encoded: EncodedTensor) -> torch.Tensor:
        factors = factor_blocks(encoded)
        dtype = encoded.torch_dtype
        if len(factors) == 1:
            return blocks_to_dense(factors[0]).to(dtype)
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        product = blocks_to_dense(factors[0]).to(acc)
        for blk in factors[1:]:
            product = product @ blocks_to_dense(blk).to(acc)
        return product.to(dtype)
