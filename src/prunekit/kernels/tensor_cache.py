"""Results derived from tensors (kernel plans, compressed weight copies), kept as an attribute of a tensor and reused
while their inputs are unchanged. torch only: this module ships in exported packages' ``runtime/``."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

import torch

__all__ = ["tensor_version", "stamp", "cached", "cached_stamped", "peek"]

T = TypeVar("T")


def tensor_version(t: torch.Tensor) -> int:
    """``t._version`` (bumped by in-place writes), or -1 for an inference tensor, which keeps no version counter
    (reading it raises); such a tensor is matched by its data pointer alone (it cannot be modified in place outside
    inference mode)."""
    return -1 if t.is_inference() else t._version


def stamp(inputs: Sequence[torch.Tensor]) -> tuple[tuple[int, int], ...]:
    """``(data pointer, version)`` of each tensor of ``inputs`` (:func:`tensor_version`): the key of a derived result.
    Called on every eager call of the runtime's layers, so the common case (no inference tensor) reads ``_version``
    directly (an inference tensor raises there, and the slower path runs)."""
    try:
        return tuple([(t.data_ptr(), t._version) for t in inputs])
    except RuntimeError:  # an inference tensor keeps no version counter
        return tuple([(t.data_ptr(), tensor_version(t)) for t in inputs])


def cached(
    owner: torch.Tensor, attr: str, inputs: Sequence[torch.Tensor], extra: Hashable, build: Callable[[], T]
) -> T:
    """``build()``, kept on ``owner`` under ``attr`` and returned again while every tensor of ``inputs`` has the same
    data pointer and version counter (:func:`tensor_version`) and ``extra`` compares equal.

    The entry also holds the storages of ``inputs``, so memory the key points to cannot be freed and handed to other
    data at the same address while the entry lives (e.g. after ``t.data = ...``): a data-pointer key alone could then
    return a stale result. The entry lives and dies with ``owner``.
    """
    return cached_stamped(owner, attr, stamp(inputs), inputs, extra, build)


def cached_stamped(
    owner: torch.Tensor,
    attr: str,
    now: tuple[tuple[int, int], ...],
    inputs: Sequence[torch.Tensor],
    extra: Hashable,
    build: Callable[[], T],
) -> T:
    """:func:`cached` with the stamp of ``inputs`` given by the caller (``now == stamp(inputs)``): for a path that runs
    on every eager call and writes the stamp out for its own tensors (``gpu.spmm_op_entry``)."""
    key = (now, extra)
    hit = getattr(owner, attr, None)
    if hit is not None and hit[0] == key:
        return hit[2]
    value = build()
    setattr(owner, attr, (key, tuple(t.untyped_storage() for t in inputs), value))
    return value


def peek(owner: torch.Tensor, attr: str, inputs: Sequence[torch.Tensor], extra: Hashable) -> object | None:
    """What :func:`cached` would return for these arguments without building it: the kept value while it is still
    valid, else None (e.g. where building is not allowed, such as inside a CUDA-graph capture)."""
    hit = getattr(owner, attr, None)
    return hit[2] if hit is not None and hit[0] == (stamp(inputs), extra) else None
