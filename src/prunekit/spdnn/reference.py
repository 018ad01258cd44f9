"""Reference inference for the Sparse DNN Graph Challenge (float64 on the CPU, or any torch device).

Per layer: Z = Y W; the bias b is added to the non-zero entries of Z only (as the challenge's
reference does); Y = min(max(Z, 0), 32). Inputs whose features have all become zero stay zero
for the rest of the network, so they are dropped as soon as they die (the champion's idea,
Hidayetoglu et al. 2020, sec. III); the survivors' indices are the "categories".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from .generator import SPDNN_RELU_CAP, SPDNN_WEIGHT, Layer
from .ops import spdnn_layer


def sparse_layer(y: torch.Tensor, layer: Layer, bias: float, cap: float = SPDNN_RELU_CAP) -> torch.Tensor:
    """One challenge layer on live inputs: ``y: (batch, N)`` -> ``(batch, N)``, same dtype and device.

    Runs ``prunekit::spdnn_layer`` (torch.sparse CSR W^T @ Y^T: the stock-torch path on either device).
    """
    offsets, inputs = layer.csr_by_output()
    values = torch.full((inputs.numel(),), SPDNN_WEIGHT, dtype=y.dtype, device=y.device)
    return spdnn_layer(y, offsets.to(y.device), inputs.to(y.device), values, bias, cap)


def infer(
    features: torch.Tensor,
    layers: Iterable[Layer],
    bias: float,
    step: Callable[[Layer, int], None] | None = None,
) -> torch.Tensor:
    """Run the network; return the 0-based indices of inputs whose final row is non-zero (sorted, int64).

    Args:
        features: ``(num_inputs, N)`` dense (binary) features; dtype sets the arithmetic (float64 = the truth).
        layers: the network, in order.
        bias: the challenge bias for N.
        step: callback ``(layer, live_inputs)`` after each layer.
    """
    live = torch.arange(features.shape[0], device=features.device)
    y = features
    for layer in layers:
        y = sparse_layer(y, layer, bias)
        alive = (y != 0).any(dim=1)
        if not bool(alive.all()):
            y, live = y[alive], live[alive]
        if step:
            step(layer, int(live.numel()))
    return live.cpu()


def dense_features(
    images: torch.Tensor, pixels: torch.Tensor, count: int, neurons: int, dtype=torch.float64
) -> torch.Tensor:
    """``(count, N)`` binary features from 0-based (image, pixel) coordinates."""
    y = torch.zeros(count, neurons, dtype=dtype)
    y[images, pixels] = 1.0
    return y
