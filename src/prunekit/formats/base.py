"""The format registry: every storage format is a class registered under its name.

Modelled on compressed-tensors (``@register("sparse-bitmask")``): a format has
``encode`` / ``decode`` / ``unfit_reason`` and nothing else; the rest of the code
looks formats up by name and never branches on them. torch only: this package is
copied into every exported package's ``runtime/``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import FormatError

__all__ = ["EncodedTensor", "SparseFormat", "register", "get_format", "format_names"]


@dataclass(frozen=True)
class EncodedTensor:
    """One weight in a storage format.

    Attributes:
        format: registry name (``csr``, ``bsr``, ``nm``, ``bitmask``, ``dense``).
        shape: dense shape ``(out_features, in_features)`` (the 2-D view for conv weights).
        dtype: dense dtype name, e.g. ``"float16"``.
        params: format parameters (ints/strings), e.g. ``{"block_rows": 16, "block_cols": 16}``.
        components: the stored tensors, keyed by component name (``values``, ``row_offsets``, ...).
    """

    format: str
    shape: tuple[int, ...]
    dtype: str
    params: dict[str, int | str] = field(default_factory=dict)
    components: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Exact storage size in bytes: the sum of the components' ``numel * element_size``."""
        return sum(t.numel() * t.element_size() for t in self.components.values())

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


class SparseFormat:
    """Interface of a storage format. Subclasses set ``name`` and implement the three methods."""

    name: str = ""

    def unfit_reason(self, dense: torch.Tensor, params: dict[str, int | str]) -> str | None:
        """Why ``dense: (out_features, in_features)`` cannot be stored in this format, or None."""
        return None

    def encode(self, dense: torch.Tensor, params: dict[str, int | str]) -> EncodedTensor:
        """Encode a 2-D dense tensor (any float dtype); zeros are the pruned entries.

        Raises:
            FormatError: the tensor does not fit (see :meth:`unfit_reason`).
        """
        raise NotImplementedError

    def decode(self, encoded: EncodedTensor) -> torch.Tensor:
        """Return the exact dense 2-D tensor (same dtype) that was encoded."""
        raise NotImplementedError

    def check(self, dense: torch.Tensor, params: dict[str, int | str]) -> None:
        if dense.dim() != 2:
            raise FormatError(f"format {self.name} stores 2-D tensors, got shape {tuple(dense.shape)}")
        if not dense.is_floating_point():
            raise FormatError(f"format {self.name} stores floating-point tensors, got {dense.dtype}")
        reason = self.unfit_reason(dense, params)
        if reason is not None:
            raise FormatError(f"format {self.name}: {reason}")


_REGISTRY: dict[str, SparseFormat] = {}


def register(cls: type[SparseFormat]) -> type[SparseFormat]:
    """Class decorator adding a format to the registry under ``cls.name``."""
    _REGISTRY[cls.name] = cls()
    return cls


def get_format(name: str) -> SparseFormat:
    """Look a format up by name.

    Raises:
        FormatError: unknown name.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise FormatError(f"unknown format {name!r}; known: {', '.join(format_names())}") from None


def format_names() -> list[str]:
    """Names of all registered formats."""
    return sorted(_REGISTRY)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``."""
    return str(dtype).removeprefix("torch.")
