"""Generate challenge data directories and run the challenge networks, timed, with the truth check.

Throughput follows the challenge: edges/s = inputs * (sum of the layers' non-zeros) / inference time;
the time counts inference only (layers already on the device), and the build time is reported apart.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import PrunekitError
from . import tsv
from .generator import SPDNN_INPUTS, SPDNN_WEIGHT, Layer, bias_for, check_neurons, iter_layers, synthetic_images
from .reference import dense_features, infer

Step = Callable[[str, int, int], None]


@dataclass
class GenerateResult:
    root: Path
    neurons: int
    layers: int
    inputs: int
    image_nnz: int
    categories: dict[int, int]  # L -> number of categories


def generate(
    root: str | Path,
    neurons: int,
    layer_counts: list[int],
    inputs: int = SPDNN_INPUTS,
    device: str = "cpu",
    overwrite: bool = False,
    step: Step | None = None,
) -> GenerateResult:
    """Write the network (layers 1..max(L)), synthetic images and float64 truth categories per L.

    Raises:
        PrunekitError: bad N, or an existing file without ``overwrite``.
    """
    check_neurons(neurons)
    root = Path(root)
    depth = max(layer_counts)
    images, pixels = synthetic_images(neurons, inputs)
    tsv.write_images(root, neurons, images, pixels, overwrite)
    layers = []
    for layer in iter_layers(neurons, depth):
        tsv.write_layer(root, layer, overwrite)
        layers.append(layer)
        if step:
            step("writing layers", layer.index, depth)
    features = dense_features(images, pixels, inputs, neurons).to(device)
    counts = {}
    wanted = sorted(set(layer_counts))
    for count in wanted:  # the 120- and 480-layer networks are prefixes of the 1920-layer one
        truth = infer(
            features,
            layers[:count],
            bias_for(neurons),
            step=lambda lay, live, count=count: step and step(f"truth L={count}", lay.index, count),
        )
        tsv.write_categories(tsv.categories_path(root, neurons, count), truth, overwrite)
        counts[count] = int(truth.numel())
    return GenerateResult(root, neurons, depth, inputs, int(images.numel()), counts)


@dataclass
class RunResult:
    neurons: int
    layers: int
    inputs: int
    device: str
    dtype: str
    build_s: float
    inference_s: float
    total_nnz: int
    categories: torch.Tensor
    passed: bool | None  # None: no truth to check against

    @property
    def edges(self) -> int:
        return self.inputs * self.total_nnz

    @property
    def teraedges_per_s(self) -> float:
        return self.edges / self.inference_s / 1e12 if self.inference_s > 0 else float("inf")


def _prepared(layer: Layer, device: str, dtype: torch.dtype):
    offsets, inputs_idx = layer.csr_by_output()
    values = torch.full((inputs_idx.numel(),), SPDNN_WEIGHT, dtype=dtype, device=device)
    return offsets.to(device), inputs_idx.to(device), values


def run_network(
    neurons: int,
    layers: int,
    data: str | Path | None = None,
    synthetic: bool = False,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    inputs: int | None = None,
    step: Step | None = None,
) -> RunResult:
    """Run the N-neuron, L-layer network on the inputs of ``data`` (or synthetic, built in memory).

    Args:
        data: a challenge data directory (official or from :func:`generate`); its categories file,
            when present, is the truth.
        synthetic: build layers and inputs from the recipe in memory (no files); the truth is then
            computed by a float64 run of the same reference path.
        inputs: use only the first ``inputs`` inputs (default: all).

    Raises:
        PrunekitError: bad N, missing files, or CUDA requested without a GPU.
    """
    check_neurons(neurons)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise PrunekitError("--device cuda: no CUDA GPU is available")
    if (data is None) == (not synthetic):
        raise PrunekitError("give --data DIR or --synthetic")
    t0 = time.perf_counter()
    if synthetic:
        net = list(iter_layers(neurons, layers))
        count = inputs or SPDNN_INPUTS
        images, pixels = synthetic_images(neurons, count)
    else:
        root = Path(data)
        net = [tsv.read_layer(root, neurons, k) for k in range(1, layers + 1)]
        images, pixels = tsv.read_images(root, neurons)
        count = int(images.max()) + 1 if images.numel() else 0
        if inputs is not None:
            keep = images < inputs
            images, pixels, count = images[keep], pixels[keep], min(inputs, count)
    prepared = [_prepared(layer, device, dtype) for layer in net]
    features = dense_features(images, pixels, count, neurons, dtype).to(device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    build_s = time.perf_counter() - t0

    from .ops import spdnn_layer

    bias = bias_for(neurons)
    t1 = time.perf_counter()
    live = torch.arange(count, device=features.device)
    y = features
    for k, (offsets, idx, values) in enumerate(prepared, start=1):
        y = spdnn_layer(y, offsets, idx, values, bias, 32.0)
        alive = (y != 0).any(dim=1)
        y, live = y[alive], live[alive]
        if step:
            step("inference", k, layers)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    inference_s = time.perf_counter() - t1
    categories = live.cpu()

    truth = None
    if synthetic:
        truth = infer(dense_features(images, pixels, count, neurons).to(device), net, bias)
    else:
        path = tsv.categories_path(Path(data), neurons, layers)
        if path.is_file() and inputs is None:
            truth = tsv.read_categories(path)
    passed = None if truth is None else torch.equal(categories, truth.cpu())
    total_nnz = sum(layer.nnz for layer in net)
    return RunResult(
        neurons,
        layers,
        count,
        device,
        str(dtype).removeprefix("torch."),
        build_s,
        inference_s,
        total_nnz,
        categories,
        passed,
    )
