"""Reference inference for the Sparse DNN Graph Challenge (float64 on the CPU, or any torch device).

Per layer: Z = Y W; the bias b is added to the non-zero entries of Z only (as the challenge's
reference does); Y = min(max(Z, 0), 32). Inputs whose features have all become zero stay zero
for the rest of the network, so they are dropped as soon as they die (the champion's idea,
Hidayetoglu et al. 2020, sec. III); the survivors' indices are the "categories".

Ties: with weights 1/16 and biases such as -0.30, a pre-activation Z + b is often exactly zero in exact
arithmetic (e.g. 24 inputs of 0.0125 give Z = 0.3). In float64 the rounding of the sum then leaves +-1e-16,
and whether an input survives depends on the summation order (measured on the N=1024 network, 300 synthetic
inputs, 4 layers: 38 survivors with exact ties, 47 with a dense float64 matmul, 39 with cuSPARSE, 38 with the
CPU CSR path). The float64 truth therefore snaps |Z + b| <= ``TIE_TOLERANCE`` to exactly zero: the exact-arithmetic
answer. In float32, -0.3f and sums of multiples of 1/16 round so that these ties come out as exactly 0.0.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable

import torch

from ..errors import PrunekitError
from .generator import SPDNN_RELU_CAP, SPDNN_WEIGHT, Layer
from .ops import spdnn_layer

TIE_TOLERANCE = 1e-10
"""float64 pre-activations with ``|Z + b| <=`` this are exact-arithmetic zeros (module docstring)."""


def snap_ties_(z: torch.Tensor) -> torch.Tensor:
    """Set float64 entries with ``|z| <= TIE_TOLERANCE`` to exactly zero, in place; other dtypes unchanged."""
    if z.dtype == torch.float64:
        z.masked_fill_(z.abs() <= TIE_TOLERANCE, 0.0)
    return z


def sparse_layer(y: torch.Tensor, layer: Layer, bias: float, cap: float = SPDNN_RELU_CAP) -> torch.Tensor:
    """One challenge layer on live inputs: ``y: (batch, N)`` -> ``(batch, N)``, same dtype and device.

    Runs ``prunekit::spdnn_layer`` (torch.sparse CSR W^T @ Y^T: the stock-torch path on either device); in
    float64, exact-arithmetic ties are snapped to zero before the cap (:func:`snap_ties_`).
    """
    offsets, inputs = layer.csr_by_output()
    values = torch.full((inputs.numel(),), SPDNN_WEIGHT, dtype=y.dtype, device=y.device)
    if y.dtype == torch.float64:  # float64: the truth path, with exact-arithmetic ties (module docstring)
        z = spdnn_layer(y, offsets.to(y.device), inputs.to(y.device), values, bias, float("inf"))
        return snap_ties_(z).clamp_(max=cap)
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


def compact_rows_(y: torch.Tensor, keep: torch.Tensor, chunk_rows: int = 1024) -> torch.Tensor:
    """Move the rows ``keep`` (sorted ascending, int64) of ``y`` to its front in place; return ``y[:len(keep)]``.

    Works in chunks of ``chunk_rows`` rows, so the extra memory is one chunk, not a second copy of ``y``
    (safe because ``keep[i] >= i``: a row is read before any later chunk can overwrite it).
    """
    for lo in range(0, keep.numel(), chunk_rows):
        hi = min(keep.numel(), lo + chunk_rows)
        y[lo:hi] = y[keep[lo:hi]]
    return y[: keep.numel()]


def truth_categories(
    features: torch.Tensor,
    layers: Iterable[Layer],
    bias: float,
    checkpoints: Iterable[int],
    batch_inputs: int = 4096,
    cap: float = SPDNN_RELU_CAP,
    step: Callable[[Layer, int], None] | None = None,
) -> dict[int, torch.Tensor]:
    """Float64 truth categories after each layer count in ``checkpoints``, with bounded memory.

    Layer-outer, input-batch-inner: each layer (streamed, so only one is held) is applied as torch.sparse CSR
    W^T to ``batch_inputs`` live rows at a time and written back in place; rows that have become all-zero are
    compacted away in place (:func:`compact_rows_`). Peak memory: ``features`` plus about six
    ``(batch_inputs, N)`` float64 temporaries plus one layer. Independent of the fused kernels (no ELL, no
    custom CUDA), so it serves as the truth for synthetic runs.

    Args:
        features: ``(inputs, N)`` float64, consumed (overwritten in place).
        layers: the network in order; at least ``max(checkpoints)`` layers are read.
        checkpoints: layer counts (e.g. 120, 480, 1920) whose categories to return.

    Returns:
        ``{L: 0-based sorted int64 CPU indices of inputs whose row is non-zero after L layers}``.
    """
    wanted = sorted(set(checkpoints))
    out: dict[int, torch.Tensor] = {}
    live = torch.arange(features.shape[0], device=features.device)
    y = features
    n = y.shape[1]
    for layer in layers:
        if not wanted or layer.index > wanted[-1]:
            break
        offsets, inputs = layer.csr_by_output()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "sparse CSR support is in beta"
            w_t = torch.sparse_csr_tensor(
                offsets.to(torch.int64),
                inputs.to(torch.int64),
                torch.full((inputs.numel(),), SPDNN_WEIGHT, dtype=y.dtype, device=y.device),
                (n, n),
                check_invariants=False,
            )
        alive = torch.zeros(y.shape[0], dtype=torch.bool, device=y.device)
        for lo in range(0, y.shape[0], batch_inputs):
            hi = min(y.shape[0], lo + batch_inputs)
            z = w_t @ y[lo:hi].t()  # (N, batch): W^T Y^T
            z = snap_ties_(torch.where(z != 0, z + bias, z)).clamp_(0.0, cap)
            alive[lo:hi] = (z != 0).any(dim=0)
            y[lo:hi] = z.t()
            del z
        if not bool(alive.all()):
            keep = torch.nonzero(alive).flatten()
            y, live = compact_rows_(y, keep), live[keep]
        if step:
            step(layer, int(live.numel()))
        if layer.index in wanted:
            out[layer.index] = live.cpu()
        if live.numel() == 0:
            break
    for count in wanted:
        if count not in out:
            if live.numel():
                raise PrunekitError(f"the network has fewer layers than {count}")
            out[count] = torch.zeros(0, dtype=torch.int64)  # every input died before this layer count
    return out
