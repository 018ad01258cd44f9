"""GPU memory budget of a challenge run: what ``run --synthetic`` holds at its peak, per network, in bytes.

The run has two phases that never overlap (the truth run ends and frees its memory before the layers are
built): the float64 truth (features of all inputs plus per-batch temporaries plus one streamed layer), and
the timed inference (every layer as ELL plus the inputs' float32 features, held for the repeated timed
runs, plus the working buffers of one input batch). The inference batch is the largest multiple of 16 inputs
whose buffers fit beside the rest in 85% of the usable memory; the driver (:mod:`prunekit.spdnn.run`) uses the same numbers.

Sizes (Kepner et al. 2019): N neurons, 32 non-zeros per neuron per layer, 60000 inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import PrunekitError
from .generator import SPDNN_INPUTS, SPDNN_LAYERS, SPDNN_NEURONS, SPDNN_NNZ_PER_ROW

H100_NBYTES = 80 * 10**9  # "80 GB" H100 (the device reports 85.0e9 bytes; budgets use the smaller figure)
RESERVED_NBYTES = 3 * 2**30  # CUDA context, cuSPARSE workspaces, allocator slack
ELL_NBYTES_PER_NZ = 8  # int32 input index + float32 value per ELL slot
TILE_INPUTS = 16  # inference batches are multiples of the tiled kernel's input tile
IMAGE_CHUNK_ELEMENTS = 1 << 24  # synthetic image rows are built this many pixels at a time
TRUTH_SHARE = 8  # the truth's per-batch temporaries get at most 1/8 of the usable memory
WORK_BUFFERS = {"fused": 3, "tiled": 3, "reference": 5}  # (batch, N) buffers alive at once, see below
HEADROOM = 0.85  # the inference phase plans for this share of the usable memory (allocator fragmentation)


@dataclass(frozen=True)
class MemoryBudget:
    """Peak device memory of one network's run, in bytes.

    ``work_nbytes`` = buffers x batch x N x 4: the fused chain holds its input, its output and the compacted
    copy (3); the tiled kernel its input and two ping-pong tiles (3); the torch.sparse path its input, the
    product, ``where``, the clamp and the transposed copy (5).
    """

    neurons: int
    layers: int
    inputs: int
    kernel: str
    device_nbytes: int
    ell_nbytes: int  # every layer: int32 index + float32 value per slot (+ the tiled kernel's int32 output order)
    features_nbytes: int  # float32 features of all inputs (kept for the timed repeats)
    build_nbytes: int  # one layer's construction temporaries + one chunk of synthetic image rows
    batch_inputs: int  # inputs per inference batch (0: nothing fits)
    work_nbytes: int  # buffers of one inference batch
    truth_batch_inputs: int
    truth_nbytes: int  # the float64 truth phase

    @property
    def usable_nbytes(self) -> int:
        return self.device_nbytes - RESERVED_NBYTES

    @property
    def inference_nbytes(self) -> int:
        return self.ell_nbytes + self.features_nbytes + self.build_nbytes + self.work_nbytes

    @property
    def peak_nbytes(self) -> int:
        return max(self.inference_nbytes, self.truth_nbytes)

    @property
    def fits(self) -> bool:
        return self.batch_inputs > 0 and self.peak_nbytes <= self.usable_nbytes


def _layer_build_nbytes(neurons: int) -> int:
    """iter_layers + csr_by_output + to_ell temporaries for one layer, and the cached base layers (int64)."""
    nnz = neurons * SPDNN_NNZ_PER_ROW
    depth = int(math.log2(max(2, neurons // 16)))
    return 16 * nnz * 8 + 2 * depth * nnz * 8


def memory_budget(
    neurons: int,
    layers: int,
    inputs: int = SPDNN_INPUTS,
    kernel: str = "fused",
    device_nbytes: int = H100_NBYTES,
    slots: int = SPDNN_NNZ_PER_ROW,
) -> MemoryBudget:
    """The peak memory of ``run --synthetic`` for one network on one device (or one rank's share of inputs).

    Args:
        neurons / layers: the network (N, L).
        inputs: inputs on this device (60000 on one GPU; 60000 / G per rank on G GPUs).
        kernel: ``fused`` | ``tiled`` | ``reference`` (how many batch buffers live at once).
        device_nbytes: the device's memory; :data:`RESERVED_NBYTES` of it is kept free.
        slots: ELL slots per output neuron (32 for the challenge networks).

    Returns:
        A :class:`MemoryBudget`; ``batch_inputs`` is the largest multiple of 16 (at most ``inputs``) that fits,
        0 when not even 16 inputs fit.

    Raises:
        PrunekitError: unknown kernel.
    """
    if kernel not in WORK_BUFFERS:
        raise PrunekitError(f"memory budget: unknown kernel {kernel!r} (choose {', '.join(WORK_BUFFERS)})")
    usable = device_nbytes - RESERVED_NBYTES
    layer_nnz = neurons * slots
    ell = layers * layer_nnz * ELL_NBYTES_PER_NZ
    ell += {"reference": layers * (neurons + 1) * 4, "tiled": layers * neurons * 4}.get(kernel, 0)
    features = inputs * neurons * 4
    build = _layer_build_nbytes(neurons) + IMAGE_CHUNK_ELEMENTS * 8 * 12
    per_input = WORK_BUFFERS[kernel] * neurons * 4
    room = int(HEADROOM * usable) - ell - features - build
    batch = 0 if room <= 0 else min(inputs, room // per_input)
    if batch < inputs:
        batch = batch // TILE_INPUTS * TILE_INPUTS
    work = batch * per_input
    truth_per_input = 6 * neurons * 8
    truth_batch = max(TILE_INPUTS, min(inputs, usable // TRUTH_SHARE // truth_per_input))
    truth = inputs * neurons * 8 + truth_batch * truth_per_input + build + 3 * layer_nnz * 8
    return MemoryBudget(
        neurons, layers, inputs, kernel, device_nbytes, ell, features, build, int(batch), int(work), truth_batch, truth
    )


H100_SMEM_OPTIN = 227 * 1024  # bytes of shared memory one block may opt into on an H100
FUSED_MIN_BLOCK_INPUTS = 4
"""``run --kernel auto`` takes the shared-memory chain only when a block holds at least this many inputs (N <= 4096
on an H100): with fewer, every block streams each layer's weights for 1-2 inputs. Measured on the H100 (2026-11-25,
``benchmarks/results/spdnn-big-...-2026-11-25.json``): at N = 16384 x 120 (one input per block) the tiled kernel ran
at 23.2 TE/s and the chain at 18.4."""


def chain_block_inputs(neurons: int, smem_optin: int = H100_SMEM_OPTIN) -> int:
    """Inputs per block of the chain kernel for N features (0: it does not fit), as ``max_block_inputs`` in
    csrc/spdnn/spdnn_chain.cu computes it: two buffers of N x stride float32, stride BT + 4 for BT % 8 == 0.

    Args:
        neurons: N. smem_optin: the device's opt-in shared memory per block, bytes (1 KiB kept for static use).
    """
    for bt in (16, 8, 4, 2, 1):
        stride = bt + 4 if bt % 8 == 0 else bt
        if 2 * neurons * stride * 4 <= smem_optin - 1024:
            return bt
    return 0


def default_kernel(neurons: int) -> str:
    """The kernel ``run --kernel auto`` picks on an H100: the chain where a block holds at least
    :data:`FUSED_MIN_BLOCK_INPUTS` inputs (N <= 4096), else tiled."""
    return "fused" if chain_block_inputs(neurons) >= FUSED_MIN_BLOCK_INPUTS else "tiled"


def budget_table(device_nbytes: int = H100_NBYTES, inputs: int = SPDNN_INPUTS) -> str:
    """Markdown table of :func:`memory_budget` for the 12 challenge networks (quoted in docs/SPDNN.md)."""
    gb = 1e9
    lines = [
        f"| N | L | kernel | layers (ELL) | features fp32 | batch (inputs) | batch buffers | inference peak "
        f"| truth peak | fits {device_nbytes / gb:.0f} GB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for neurons in SPDNN_NEURONS:
        for layers in SPDNN_LAYERS:
            b = memory_budget(neurons, layers, inputs, default_kernel(neurons), device_nbytes)
            lines.append(
                f"| {neurons} | {layers} | {b.kernel} | {b.ell_nbytes / gb:.2f} GB | {b.features_nbytes / gb:.2f} GB "
                f"| {b.batch_inputs} | {b.work_nbytes / gb:.2f} GB | {b.inference_nbytes / gb:.2f} GB "
                f"| {b.truth_nbytes / gb:.2f} GB | {'yes' if b.fits else 'no'} |"
            )
    return "\n".join(lines) + "\n"
