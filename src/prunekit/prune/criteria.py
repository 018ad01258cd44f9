"""Pruning criteria: a score per weight element, higher = more important.

- ``magnitude``: ``|W|`` (Han et al., "Learning both Weights and Connections", NeurIPS 2015;
  the one-shot form of Zhu & Gupta 2017's gradual magnitude pruning, GMP).

Criteria are looked up by name; methods needing calibration data (Wanda, SparseGPT)
register here too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import PatternError

Criterion = Callable[[torch.Tensor], torch.Tensor]


def magnitude(weight: torch.Tensor) -> torch.Tensor:
    """Score ``|W|`` in float32; ``weight: (out_features, in_features)`` -> same shape."""
    return weight.detach().float().abs()


CRITERIA: dict[str, Criterion] = {"magnitude": magnitude}


def get_criterion(name: str) -> Criterion:
    """Look a criterion up by name.

    Raises:
        PatternError: unknown method.
    """
    try:
        return CRITERIA[name]
    except KeyError:
        raise PatternError(f"unknown pruning method {name!r}; known: {', '.join(sorted(CRITERIA))}") from None
