"""The fused Sparse DNN Graph Challenge kernel (``csrc/spdnn/spdnn_chain.cu``): build, load and drive it.

The kernel keeps a block of inputs' features in shared memory across a chain of layers (SpMM + bias on
non-zeros + ReLU + cap, fused); between chains the host drops inputs that have become all-zero and
compacts the rest (Hidayetoglu et al., HPEC 2020, sec. III: the champion's design, plus multi-layer
fusion). Layers are given in ELL form, slot-major: ``ell_idx (layers, slots, N)`` int32 input neuron of
each (slot, output neuron), ``ell_val`` float32 (0 in padding slots).

Built with torch.utils.cpp_extension into the same cache as the other kernels (see ``build.py``), as
its own small library. torch + stdlib only.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .build import Extension, load_extension

CSRC_DIR = Path(__file__).resolve().parent / "csrc" / "spdnn"
SOURCES = ("spdnn_chain.cu",)
MAX_CHAIN = 64  # layers per launch once few inputs are left

EXTENSION = Extension(
    namespace="prunekit_spdnn",
    prefix="prunekit_spdnn",
    csrc_dir=CSRC_DIR,
    sources=SOURCES,
    probe="chain",
    description="fused SpDNN kernel",
    prebuilt=False,  # benchmark/challenge kernel: never shipped in an exported package
)


def load(verbose: bool = False) -> None:
    """Build (once per source/torch/CUDA/arch key) and load the fused kernel.

    Raises:
        KernelUnavailable: no CUDA torch, GPU, or compiler, or the build failed.
    """
    load_extension(EXTENSION, verbose)


def block_inputs(neurons: int) -> int:
    """Inputs per thread block for N features (0: N does not fit in shared memory; use the reference path)."""
    load()
    return int(torch.ops.prunekit_spdnn.max_block_inputs(neurons))


def to_ell(
    row_offsets: torch.Tensor, column_indices: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """W^T CSR (one row per output neuron) -> slot-major ELL ``(slots, N)`` int32 indices and float32 values."""
    n = row_offsets.numel() - 1
    counts = (row_offsets[1:] - row_offsets[:-1]).long()
    slots = int(counts.max()) if n else 0
    rows = torch.repeat_interleave(torch.arange(n, device=counts.device), counts)
    slot = torch.arange(column_indices.numel(), device=counts.device) - row_offsets[:-1].long()[rows]
    idx = torch.zeros(slots, n, dtype=torch.int32, device=counts.device)
    val = torch.zeros(slots, n, dtype=torch.float32, device=counts.device)
    idx[slot, rows] = column_indices.to(torch.int32)
    val[slot, rows] = values.to(torch.float32)
    return idx, val


def infer_fused(
    features: torch.Tensor, ell_idx: torch.Tensor, ell_val: torch.Tensor, bias: float, cap: float
) -> torch.Tensor:
    """Run every layer; return the 0-based indices of inputs whose final row is non-zero (CPU int64, sorted).

    Args:
        features: ``(inputs, N)`` float32 CUDA.
        ell_idx / ell_val: ``(layers, slots, N)`` (see :func:`to_ell`), on the same device.

    Launches chains of 1, 1, 2, 4, ... (up to :data:`MAX_CHAIN`) layers, dropping dead inputs between them.
    """
    load()
    layers = ell_idx.shape[0]
    live = torch.arange(features.shape[0], device=features.device)
    y = features.float().contiguous()
    done, chain = 0, 1
    while done < layers and y.shape[0] > 0:
        stop = min(layers, done + chain)
        y, alive = torch.ops.prunekit_spdnn.chain(y, ell_idx[done:stop], ell_val[done:stop], bias, cap)
        keep = alive.bool()
        y, live = y[keep], live[keep]
        done, chain = stop, min(MAX_CHAIN, chain * 2 if stop > 1 else 1)
    return live.cpu()
