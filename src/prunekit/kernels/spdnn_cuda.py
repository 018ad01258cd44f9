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

import hashlib
import threading
from pathlib import Path

import torch

from ..errors import KernelUnavailable
from .build import build_key, cache_root, gencode_flags, target_archs, unavailable_reason

SOURCE = Path(__file__).resolve().parent / "csrc" / "spdnn" / "spdnn_chain.cu"
MAX_CHAIN = 64  # layers per launch once few inputs are left
_lock = threading.Lock()


def _loaded() -> bool:
    try:
        torch.ops.prunekit_spdnn.chain  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def load(verbose: bool = False) -> None:
    """Build (once per source/torch/CUDA/arch key) and load the fused kernel.

    Raises:
        KernelUnavailable: no CUDA torch, GPU, or compiler, or the build failed.
    """
    with _lock:
        if _loaded():
            return
        reason = unavailable_reason()
        if reason is not None:
            raise KernelUnavailable(f"the fused SpDNN kernel is unavailable: {reason}.")
        from torch.utils import cpp_extension

        archs = target_archs(torch.cuda.get_device_capability())
        key = build_key(hashlib.sha256(SOURCE.read_bytes()).hexdigest(), torch.__version__, torch.version.cuda, archs)
        name = f"prunekit_spdnn_{key[:16]}"
        build_dir = cache_root() / name
        build_dir.mkdir(parents=True, exist_ok=True)
        try:
            cpp_extension.load(
                name=name,
                sources=[str(SOURCE)],
                extra_cuda_cflags=["-O3", "-lineinfo", *gencode_flags(archs)],
                build_directory=str(build_dir),
                verbose=verbose,
                is_python_module=False,
            )
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise KernelUnavailable(
                f"building the fused SpDNN kernel failed ({first}); build folder {build_dir}"
            ) from exc


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
