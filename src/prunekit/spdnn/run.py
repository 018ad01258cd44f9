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
from .generator import (
    SPDNN_INPUTS,
    SPDNN_RELU_CAP,
    SPDNN_WEIGHT,
    Layer,
    bias_for,
    check_neurons,
    iter_layers,
    relabel,
    synthetic_images,
)
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
    kernel: str  # "fused" (prunekit's CUDA chain kernel) or "reference" (torch.sparse per layer)
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
    kernel: str = "auto",
    repeats: int = 1,
    relabel_seed: int | None = None,
) -> RunResult:
    """Run the N-neuron, L-layer network on the inputs of ``data`` (or synthetic, built in memory).

    Args:
        data: a challenge data directory (official or from :func:`generate`); its categories file,
            when present, is the truth.
        synthetic: build layers and inputs from the recipe in memory (no files); the truth is then
            computed by a float64 run of the same reference path.
        inputs: use only the first ``inputs`` inputs (default: all).
        kernel: ``fused`` (CUDA, float32), ``reference`` (``prunekit::spdnn_layer`` via torch.sparse, any
            device/dtype), or ``auto`` (fused on CUDA when N fits in shared memory and dtype is float32).
        repeats: timed runs after one warm-up run when > 1; the median is reported.
        relabel_seed: run the network with its hidden neurons renamed (:func:`relabel`), same function.

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
        net = list(iter_layers(neurons, layers, device))
        if relabel_seed is not None:
            net = relabel(net, relabel_seed)
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
    kernel = _choose_kernel(kernel, neurons, device, dtype)
    features = dense_features(images, pixels, count, neurons, dtype).to(device)
    bias = bias_for(neurons)
    ell_idx = ell_val = prepared = None
    if kernel == "fused":
        from ..kernels import spdnn_cuda

        ells = [spdnn_cuda.to_ell(*_prepared(layer, device, torch.float32)) for layer in net]
        ell_idx = torch.stack([e[0] for e in ells])
        ell_val = torch.stack([e[1] for e in ells])
    else:
        prepared = [_prepared(layer, device, dtype) for layer in net]
    _sync(device)
    build_s = time.perf_counter() - t0

    def inference() -> torch.Tensor:
        if kernel == "fused":
            return spdnn_cuda.infer_fused(features, ell_idx, ell_val, bias, SPDNN_RELU_CAP)
        from .ops import spdnn_layer

        live = torch.arange(count, device=features.device)
        y = features
        for k, (offsets, idx, values) in enumerate(prepared, start=1):
            y = spdnn_layer(y, offsets, idx, values, bias, SPDNN_RELU_CAP)
            alive = (y != 0).any(dim=1)
            y, live = y[alive], live[alive]
            if step:
                step("inference", k, layers)
        return live.cpu()

    if repeats > 1:
        inference()  # warm-up: first launches, allocator, JIT
    times = []
    for _ in range(max(1, repeats)):
        _sync(device)
        t1 = time.perf_counter()
        categories = inference()
        _sync(device)
        times.append(time.perf_counter() - t1)
    inference_s = sorted(times)[len(times) // 2]

    ell_idx = ell_val = prepared = features = None  # free the device copies before the float64 truth run
    truth = None
    if synthetic:
        truth = infer(dense_features(images, pixels, count, neurons).to(device), net, bias)  # float64
    else:
        path = tsv.categories_path(Path(data), neurons, layers)
        if path.is_file() and inputs is None:
            truth = tsv.read_categories(path)
    passed = None if truth is None else torch.equal(categories, truth.cpu())
    total_nnz = sum(layer.nnz for layer in net)
    dtype_name = str(dtype).removeprefix("torch.")
    return RunResult(
        neurons, layers, count, device, dtype_name, kernel, build_s, inference_s, total_nnz, categories, passed
    )


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _choose_kernel(kernel: str, neurons: int, device: str, dtype: torch.dtype) -> str:
    if kernel not in ("auto", "fused", "reference"):
        raise PrunekitError(f"--kernel {kernel!r}: choose auto, fused or reference")
    if kernel == "reference":
        return kernel
    on_cuda = device.startswith("cuda")
    if kernel == "fused" and (not on_cuda or dtype != torch.float32):
        raise PrunekitError("--kernel fused runs on CUDA in float32")
    if not on_cuda or dtype != torch.float32:
        return "reference"
    from ..kernels import spdnn_cuda

    if spdnn_cuda.block_inputs(neurons) == 0:
        if kernel == "fused":
            raise PrunekitError(f"--kernel fused: N={neurons} features do not fit in shared memory")
        return "reference"
    return "fused"
