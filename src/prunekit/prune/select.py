"""Which tensors of a checkpoint are pruned.

By default: floating-point weights of linear layers (2-D ``*.weight``) and conv layers
(3-D/4-D ``*.weight``, viewed as ``(out_channels, in_channels * prod(kernel))``). Embeddings,
norms, biases and output heads stay dense unless a user's ``--include`` regex names them;
``--exclude`` regexes remove tensors. Names matched by ``--include`` are "named
explicitly": if such a tensor cannot take the pattern, pruning fails instead of skipping it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import PatternError

# Name fragments of tensors that are not hidden linear layers (HF naming conventions).
EMBEDDING_RE = re.compile(r"(^|\.)(embed\w*|wte|wpe|word_embeddings|position_embeddings|token_type_embeddings)(\.|$)")
HEAD_RE = re.compile(r"(^|\.)(lm_head|classifier|pooler|score|qa_outputs|embed_out|cls|head|output_projection)(\.|$)")


@dataclass(frozen=True)
class Selection:
    """Result of :func:`select_tensors`.

    Attributes:
        selected: names to prune, in checkpoint order.
        explicit: the subset named by an ``--include`` regex.
    """

    selected: list[str]
    explicit: set[str]


def _compile(patterns: list[str] | None, what: str) -> list[re.Pattern]:
    compiled = []
    for text in patterns or []:
        try:
            compiled.append(re.compile(text))
        except re.error as exc:
            raise PatternError(f"invalid {what} regex {text!r}: {exc}") from None
    return compiled


def is_default_prunable(name: str, ndim: int, floating: bool) -> bool:
    """True for linear/conv weights that are neither embeddings nor output heads."""
    return (
        floating
        and ndim >= 2
        and name.endswith("weight")
        and not EMBEDDING_RE.search(name)
        and not HEAD_RE.search(name)
    )


def select_tensors(
    tensors: list[tuple[str, int, bool]],
    include: list[str] | None = None,
    exclude: list[str] | None = None,
) -> Selection:
    """Pick the tensors to prune.

    Args:
        tensors: ``(name, ndim, is_floating_point)`` per tensor, in checkpoint order.
        include: regexes (``re.search``); when given, exactly the matching tensors are candidates.
        exclude: regexes removing candidates.

    Raises:
        PatternError: an invalid regex, or an explicitly included tensor that is 1-D or not floating point.
    """
    inc, exc = _compile(include, "--include"), _compile(exclude, "--exclude")
    selected, explicit = [], set()
    for name, ndim, floating in tensors:
        if any(p.search(name) for p in exc):
            continue
        if inc:
            if not any(p.search(name) for p in inc):
                continue
            if not floating:
                raise PatternError(f"{name}: an integer tensor cannot be pruned (named by --include)")
            if ndim < 2:
                raise PatternError(f"{name}: a {ndim}-D tensor cannot be pruned (named by --include)")
            explicit.add(name)
            selected.append(name)
        elif is_default_prunable(name, ndim, floating):
            selected.append(name)
    return Selection(selected, explicit)
