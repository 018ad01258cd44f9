"""Dense format: the tensor stored as it is (embeddings, norms, layers not worth sparsifying)."""

from __future__ import annotations

import torch

from .base import EncodedTensor, SparseFormat, dtype_name, register


@register
class Dense(SparseFormat):
    """Component ``weight: (out_features, in_features)``, unchanged."""

    name = "dense"

    def encode(self, dense: torch.Tensor, params: dict[str, int | str]) -> EncodedTensor:
        self.check(dense, params)
        return EncodedTensor(self.name, tuple(dense.shape), dtype_name(dense.dtype), {}, {"weight": dense.contiguous()})

    def decode(self, encoded: EncodedTensor) -> torch.Tensor:
        return encoded.components["weight"]
