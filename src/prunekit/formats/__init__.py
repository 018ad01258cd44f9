"""Kernel-ready storage formats behind one registry (see ``base``).

``encode(dense, params) -> EncodedTensor``, ``decode(encoded) -> dense``, and
``EncodedTensor.nbytes`` for the exact stored size. torch only.
"""

from __future__ import annotations

from . import bitmask, bsr, csr, dense, ks, nm  # noqa: F401  (registration)
from .base import EncodedTensor, SparseFormat, format_names, get_format, register

__all__ = ["EncodedTensor", "SparseFormat", "format_names", "get_format", "register", "encode", "decode"]


def encode(name: str, weight, params: dict | None = None) -> EncodedTensor:
    """Encode a 2-D ``weight`` in the format ``name`` (see :func:`get_format`)."""
    return get_format(name).encode(weight, params or {})


def decode(encoded: EncodedTensor):
    """Dense 2-D tensor of an :class:`EncodedTensor` (exact round trip)."""
    return get_format(encoded.format).decode(encoded)
