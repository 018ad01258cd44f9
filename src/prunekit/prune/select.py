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
        include: regexes (``re.search``); when given, the matching floating-point tensors of 2 or
            more dimensions are the candidates (1-D and integer matches are ignored).
        exclude: regexes removing candidates.

    Raises:
        PatternError: an invalid regex, or an ``--include`` regex that names no prunable tensor.
    """
    inc, exc = _compile(include, "--include"), _compile(exclude, "--exclude")
    kept = [(name, ndim, floating) for name, ndim, floating in tensors if not any(p.search(name) for p in exc)]
    if not inc:
        return Selection([name for name, ndim, floating in kept if is_default_prunable(name, ndim, floating)], set())
    explicit: set[str] = set()
    for regex in inc:
        matches = [(name, ndim, floating) for name, ndim, floating in kept if regex.search(name)]
        usable = [name for name, ndim, floating in matches if floating and ndim >= 2]
        if not usable:
            if not matches:
                raise PatternError(f"--include {regex.pattern!r} matches no tensor")
            name, ndim, floating = matches[0]
            kind = "an integer tensor" if not floating else f"a {ndim}-D tensor"
            raise PatternError(
                f"--include {regex.pattern!r} names only tensors that cannot be pruned ({name} is {kind})"
            )
        explicit.update(usable)
    return Selection([name for name, _, _ in kept if name in explicit], explicit)
