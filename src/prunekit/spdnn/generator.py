"""The Sparse DNN Graph Challenge networks and inputs (Kepner et al., HPEC 2019; Hidayetoglu et al., HPEC 2020).

Layer recipe (RadiX-Net style, established from the official N=1024 files, 0-based indices):
n = N/16, d = log2(n); layer k (1-based) uses s = 2^((k-1) mod d); E_s is n x n with
E_s[i, j] = 1 iff (i - j) mod n is 0 or s; K = kron(ones(16, 16), E_s) / 16, so every row and
column has 32 non-zeros of value 1/16. Layers come in blocks of d: block 1 is K as is; each later
block draws x = rand(N) from MT19937 seeded 5489 (``numpy.random.RandomState(5489).random_sample``,
draws consecutive across blocks), p = stable argsort(x), and every layer of the block is
W = K[argsort(p), :] (W[p[i], :] = K[i, :]). Row = input neuron, column = output neuron.
The generator is reseeded for each N (whether the official generator is, for N > 1024, is not
established).

Inputs: the official inputs are MNIST images, which cannot be downloaded here; synthetic binary
images with the official total non-zero counts are generated instead (deterministic, seeded).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import PrunekitError

SPDNN_NEURONS = (1024, 4096, 16384, 65536)
SPDNN_LAYERS = (120, 480, 1920)
SPDNN_BIAS = {1024: -0.30, 4096: -0.35, 16384: -0.40, 65536: -0.45}  # GC 2019, per N
SPDNN_RELU_CAP = 32.0  # GC 2019: Y = min(max(YW + b, 0), 32)
SPDNN_WEIGHT = 1.0 / 16.0  # every non-zero weight
SPDNN_NNZ_PER_ROW = 32
SPDNN_INPUTS = 60000
SPDNN_SEED = 5489  # MT19937 default seed, used by the official generator
OFFICIAL_IMAGE_NNZ = {1024: 6374505, 4096: 25019051, 16384: 98858913, 65536: 392191985}
OFFICIAL_CATEGORY_COUNTS = {1024: 1812, 4096: 1801, 16384: 1918, 65536: 1994}  # with the official MNIST images
SYNTHETIC_IMAGE_SEED = 2020


def check_neurons(neurons: int) -> int:
    """Validate N: a multiple of 16 whose N/16 is a power of two >= 2.

    Raises:
        PrunekitError: otherwise.
    """
    n = neurons // 16
    if neurons % 16 or n < 2 or n & (n - 1):
        raise PrunekitError(f"--neurons {neurons}: N must be 16 x a power of two (challenge sizes: {SPDNN_NEURONS})")
    return neurons


def bias_for(neurons: int) -> float:
    """The challenge bias for N; other N (test sizes) use the N=1024 bias."""
    return SPDNN_BIAS.get(neurons, SPDNN_BIAS[1024])


def base_layer(neurons: int, stride: int, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Non-zeros of K = kron(ones(16,16), E_s) / 16, as (rows, cols) int64 sorted by row then column."""
    n = neurons // 16
    rows = torch.arange(neurons, device=device).repeat_interleave(SPDNN_NNZ_PER_ROW)
    i = rows % n
    slot = torch.arange(SPDNN_NNZ_PER_ROW, device=device).repeat(neurons)
    block = slot // 2  # which of the 16 column blocks
    j = torch.where(slot % 2 == 0, i, (i - stride) % n)  # E_s[i, j] = 1 iff (i - j) mod n in {0, s}
    cols = block * n + j
    order = torch.argsort(rows * neurons + cols)
    return rows[order], cols[order]


@dataclass(frozen=True)
class Layer:
    """One challenge layer: W (N x N) with ``rows``/``cols`` int64 (0-based, sorted by row), all values 1/16."""

    index: int  # 1-based
    neurons: int
    rows: torch.Tensor
    cols: torch.Tensor

    @property
    def nnz(self) -> int:
        return int(self.rows.numel())

    def dense(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        w = torch.zeros(self.neurons, self.neurons, dtype=dtype, device=self.rows.device)
        w[self.rows, self.cols] = SPDNN_WEIGHT
        return w

    def csr_by_output(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W^T in CSR: ``row_offsets (N+1,)`` int32 and ``column_indices (nnz,)`` int32 (inputs of each output)."""
        order = torch.argsort(self.cols * self.neurons + self.rows)
        counts = torch.bincount(self.cols, minlength=self.neurons)
        offsets = torch.zeros(self.neurons + 1, dtype=torch.int64, device=self.cols.device)
        offsets[1:] = torch.cumsum(counts, 0)
        return offsets.to(torch.int32), self.rows[order].to(torch.int32)


def iter_layers(neurons: int, layers: int, device: str | torch.device = "cpu") -> Iterator[Layer]:
    """The first ``layers`` layers of the challenge network with N = ``neurons``, in order (tensors on ``device``)."""
    check_neurons(neurons)
    n = neurons // 16
    depth = int(math.log2(n))
    rng = np.random.RandomState(SPDNN_SEED)
    row_map = torch.arange(neurons, device=device)
    bases = {}
    for k in range(1, layers + 1):
        if k > depth and (k - 1) % depth == 0:  # first layer of a later block: draw its permutation
            p = np.argsort(rng.random_sample(neurons), kind="stable")
            row_map = torch.from_numpy(p.astype(np.int64)).to(device)
        stride = 2 ** ((k - 1) % depth)
        if stride not in bases:
            bases[stride] = base_layer(neurons, stride, device)
        rows, cols = bases[stride]
        new_rows = row_map[rows]  # W[p[i], :] = K[i, :]
        order = torch.argsort(new_rows * neurons + cols)
        yield Layer(k, neurons, new_rows[order], cols[order])


def relabel(layers: list[Layer], seed: int = 0) -> list[Layer]:
    """The same network with its hidden neurons renamed by one random permutation per hidden layer boundary.

    Layer k's columns and layer k+1's rows get the same permutation, so the function computed is unchanged
    (the input pixels and the final outputs keep their names). Used to check that a kernel does not depend
    on the generator's structure (issue: TE/s within 10% on the relabelled network).
    """
    g = torch.Generator().manual_seed(seed)
    out, prev_perm = [], None
    for k, layer in enumerate(layers):
        rows, cols = layer.rows, layer.cols
        if prev_perm is not None:
            rows = prev_perm[rows]
        if k < len(layers) - 1:
            perm = torch.randperm(layer.neurons, generator=g).to(cols.device)
            cols = perm[cols]
            prev_perm = perm
        order = torch.argsort(rows * layer.neurons + cols)
        out.append(Layer(layer.index, layer.neurons, rows[order], cols[order]))
    return out


def synthetic_images(
    neurons: int, count: int = SPDNN_INPUTS, total_nnz: int | None = None, seed: int = SYNTHETIC_IMAGE_SEED
):
    """Binary stroke images standing in for MNIST: ``(image_index, pixel_index)`` int64, 0-based, sorted.

    Each image is a sqrt(N) x sqrt(N) grid (column-major pixel index, as the official files) on which
    four thick pen strokes are drawn, like handwritten digits; then exactly its share of lit pixels is
    kept (a random subset of the stroke pixels, topped up at random if the strokes are short). The
    per-image counts vary 0.6-1.4x around the mean, and the total equals ``total_nnz`` (default: the
    official count scaled to ``count`` images, or 10% density for other N). Deterministic for a seed.
    """
    side = math.isqrt(neurons)
    if side * side != neurons:
        raise PrunekitError(f"synthetic images need a square N (sqrt(N) x sqrt(N) pixels), got N={neurons}")
    if total_nnz is None:
        official = OFFICIAL_IMAGE_NNZ.get(neurons)
        total_nnz = round(official * count / SPDNN_INPUTS) if official else round(0.1 * neurons * count)
    g = torch.Generator().manual_seed(seed)
    mean = total_nnz / count
    lit = torch.round(mean * (0.6 + 0.8 * torch.rand(count, generator=g))).long().clamp(1, neurons)
    diff = int(total_nnz - lit.sum())
    while diff != 0:  # fix the total exactly, one pixel at a time on random images
        idx = torch.randint(0, count, (min(abs(diff), count),), generator=g).unique()
        step = 1 if diff > 0 else -1
        idx = idx[(lit[idx] + step >= 1) & (lit[idx] + step <= neurons)][: abs(diff)]
        lit[idx] += step
        diff -= step * int(idx.numel())

    strokes, points = 4, 2 * side
    radius = max(1, round(side / 28))
    offsets = [
        (dr, dc)
        for dr in range(-radius, radius + 1)
        for dc in range(-radius, radius + 1)
        if dr * dr + dc * dc <= radius * radius
    ]
    off = torch.tensor(offsets, dtype=torch.float64)  # (O, 2)
    t = torch.linspace(0, 1, points, dtype=torch.float64)
    images, pixels = [], []
    chunk = max(1, (1 << 22) // neurons)
    for start in range(0, count, chunk):
        stop = min(count, start + chunk)
        b = stop - start
        origin = (0.2 + 0.6 * torch.rand(b, strokes, 2, generator=g, dtype=torch.float64)) * side
        angle = torch.rand(b, strokes, generator=g, dtype=torch.float64) * 2 * math.pi
        length = (0.3 + 0.3 * torch.rand(b, strokes, generator=g, dtype=torch.float64)) * side
        direction = torch.stack([torch.cos(angle), torch.sin(angle)], dim=-1) * length[..., None]
        pts = origin[:, :, None, :] + t[None, None, :, None] * direction[:, :, None, :]  # (b, S, P, 2)
        pts = (pts[:, :, :, None, :] + off).round().long().clamp(0, side - 1)  # (b, S, P, O, 2)
        flat = (pts[..., 1] * side + pts[..., 0]).reshape(b, -1)  # column-major: col * side + row
        on_stroke = torch.zeros(b, neurons, dtype=torch.bool)
        on_stroke.scatter_(1, flat, True)
        score = torch.rand(b, neurons, generator=g) + on_stroke.float()  # stroke pixels first, random order
        need = int(lit[start:stop].max())
        top = torch.topk(score, need, dim=1).indices
        keep = torch.arange(need).expand(b, -1) < lit[start:stop, None]
        images.append(torch.arange(start, stop)[:, None].expand(-1, need)[keep])
        pixels.append(top[keep])
    images, pixels = torch.cat(images), torch.cat(pixels)
    order = torch.argsort(images * neurons + pixels)
    return images[order], pixels[order]
