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
from collections.abc import Iterable, Iterator
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


def relabel(layers: Iterable[Layer], seed: int = 0) -> Iterator[Layer]:
    """The same network with its hidden neurons renamed by one random permutation per hidden layer boundary.

    Layer k's columns and layer k+1's rows get the same permutation, so the function computed is unchanged
    (the input pixels and the final outputs keep their names). Used to check that a kernel does not depend
    on the generator's structure (issue: TE/s within 10% on the relabelled network). Streams: holds one
    layer at a time (the last layer keeps its columns, so the generator looks one layer ahead).
    """
    g = torch.Generator().manual_seed(seed)
    prev_perm = None
    it = iter(layers)
    layer = next(it, None)
    while layer is not None:
        following = next(it, None)
        rows, cols = layer.rows, layer.cols
        if prev_perm is not None:
            rows = prev_perm[rows]
        prev_perm = None
        if following is not None:
            perm = torch.randperm(layer.neurons, generator=g).to(cols.device)
            cols = perm[cols]
            prev_perm = perm
        order = torch.argsort(rows * layer.neurons + cols)
        yield Layer(layer.index, layer.neurons, rows[order], cols[order])
        layer = following


SYNTHETIC_STROKES = 4  # pen strokes per synthetic image
SYNTHETIC_SHIFT = 7919  # per-image rotation of the pixel ranking (a prime)


@dataclass(frozen=True)
class SyntheticImages:
    """Binary stroke images standing in for MNIST; rows are computed on demand on any device, bit for bit alike.

    Image ``m`` is a sqrt(N) x sqrt(N) grid (column-major pixel index ``col * side + row``, as the official
    files) with :data:`SYNTHETIC_STROKES` thick pen strokes: pixel P is on a stroke iff its distance to the
    stroke's segment [A, B] is at most ``radius`` (tested exactly). Exactly ``lit[m]`` pixels
    are lit: stroke pixels first, in the order of a per-image rotation of one random pixel ranking, then
    off-stroke pixels in that order when the strokes are short. Per pixel only integer ops (and float64 ops on
    small integers, which are exact) run, so CPU and CUDA give the same images; the per-image parameters (counts, stroke end points) come from a CPU ``torch.Generator``.

    Attributes:
        lit: ``(count,)`` int64 lit pixels per image (total = the requested non-zero count).
        ends: ``(count, SYNTHETIC_STROKES, 4)`` int64 stroke end points ``(a_row, a_col, b_row, b_col)``.
        pixel_rank: ``(N,)`` int64 random permutation; image m ranks pixel p by ``(rank[p] + 7919 m) mod N``.
    """

    neurons: int
    count: int
    seed: int
    radius: int
    lit: torch.Tensor
    ends: torch.Tensor
    pixel_rank: torch.Tensor

    @property
    def side(self) -> int:
        return math.isqrt(self.neurons)

    @property
    def nnz(self) -> int:
        return int(self.lit.sum())

    def rows(
        self,
        start: int,
        stop: int,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        chunk_elements: int = 1 << 22,
    ) -> torch.Tensor:
        """Dense binary features of images ``start..stop-1``: ``(stop - start, N)`` of ``dtype`` on ``device``."""
        out = torch.zeros(stop - start, self.neurons, dtype=dtype, device=device)
        for lo, hi, top in self._chunks(start, stop, device, chunk_elements):
            lit = (top >= 0).to(dtype)  # padding (-1) adds 0 to pixel 0; lit pixels are distinct: values are 0/1
            out[lo - start : hi - start].scatter_add_(1, top.clamp_min(0), lit)
        return out

    def coordinates(
        self, start: int = 0, stop: int | None = None, device: str | torch.device = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(image_index, pixel_index)`` int64, 0-based, sorted (CPU), of images ``start..stop-1``."""
        stop = self.count if stop is None else stop
        images, pixels = [], []
        for lo, hi, top in self._chunks(start, stop, device, 1 << 22):
            pix = torch.sort(top, dim=1).values.cpu()
            keep = pix >= 0
            images.append(torch.arange(lo, hi)[:, None].expand_as(pix)[keep])
            pixels.append(pix[keep])
        if not images:
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
        return torch.cat(images), torch.cat(pixels)

    def _chunks(self, start: int, stop: int, device, chunk_elements: int):
        """Yield ``(lo, hi, top)``: ``top (hi - lo, need)`` int64 lit pixel indices (``-1`` pads short rows)."""
        n, side, r2 = self.neurons, self.side, float(self.radius * self.radius)
        step = max(1, chunk_elements // n)
        pixel = torch.arange(n, device=device)
        # integer-valued float64: every product below is < 2^36, so exact on any device
        p_row, p_col = (pixel % side).double(), (pixel // side).double()
        rank = self.pixel_rank.to(device)
        for lo in range(start, stop, step):
            hi = min(stop, lo + step)
            ends = self.ends[lo:hi].to(device=device, dtype=torch.float64)
            on = torch.zeros(hi - lo, n, dtype=torch.bool, device=device)
            for s in range(ends.shape[1]):
                a_r, a_c, b_r, b_c = (ends[:, s, q, None] for q in range(4))
                v_r, v_c = b_r - a_r, b_c - a_c
                w_r, w_c = p_row - a_r, p_col - a_c
                dot = w_r * v_r + w_c * v_c
                len2 = v_r * v_r + v_c * v_c
                ww = w_r * w_r + w_c * w_c
                pb = (w_r - v_r) ** 2 + (w_c - v_c) ** 2
                inside = ww * len2 - dot * dot <= r2 * len2  # squared distance to the line <= r^2
                on |= torch.where(dot <= 0, ww <= r2, torch.where(dot >= len2, pb <= r2, inside))
            shift = (torch.arange(lo, hi, device=device)[:, None] * SYNTHETIC_SHIFT) % n
            key = (rank + shift) % n + on.long() * n  # distinct within a row: stroke pixels rank first
            lit = self.lit[lo:hi].to(device)
            need = int(self.lit[lo:hi].max())
            top = torch.topk(key, need, dim=1, sorted=True).indices
            yield lo, hi, torch.where(torch.arange(need, device=device) < lit[:, None], top, -1)


def synthetic_image_set(
    neurons: int, count: int = SPDNN_INPUTS, total_nnz: int | None = None, seed: int = SYNTHETIC_IMAGE_SEED
) -> SyntheticImages:
    """The synthetic inputs for N: per-image lit counts 0.6-1.4x the mean, exact total, stroke end points.

    ``total_nnz`` defaults to the official count scaled to ``count`` images (10% density for other N).
    Deterministic for a seed.

    Raises:
        PrunekitError: N is not a square (sqrt(N) x sqrt(N) pixels).
    """
    side = math.isqrt(neurons)
    if side * side != neurons:
        raise PrunekitError(f"synthetic images need a square N (sqrt(N) x sqrt(N) pixels), got N={neurons}")
    if total_nnz is None:
        official = OFFICIAL_IMAGE_NNZ.get(neurons)
        total_nnz = round(official * count / SPDNN_INPUTS) if official else round(0.1 * neurons * count)
    g = torch.Generator().manual_seed(seed)
    mean = total_nnz / max(1, count)
    lit = torch.round(mean * (0.6 + 0.8 * torch.rand(count, generator=g))).long().clamp(1, neurons)
    diff = int(total_nnz - lit.sum())
    while diff != 0 and count:  # fix the total exactly, one pixel at a time on random images
        idx = torch.randint(0, count, (min(abs(diff), count),), generator=g).unique()
        step = 1 if diff > 0 else -1
        idx = idx[(lit[idx] + step >= 1) & (lit[idx] + step <= neurons)][: abs(diff)]
        lit[idx] += step
        diff -= step * int(idx.numel())
    origin = (0.2 + 0.6 * torch.rand(count, SYNTHETIC_STROKES, 2, generator=g, dtype=torch.float64)) * side
    angle = torch.rand(count, SYNTHETIC_STROKES, generator=g, dtype=torch.float64) * 2 * math.pi
    length = (0.3 + 0.3 * torch.rand(count, SYNTHETIC_STROKES, generator=g, dtype=torch.float64)) * side
    direction = torch.stack([torch.cos(angle), torch.sin(angle)], dim=-1) * length[..., None]
    a = origin.round().long().clamp(0, side - 1)
    b = (origin + direction).round().long().clamp(0, side - 1)
    ends = torch.cat([a, b], dim=-1)  # (count, strokes, 4)
    rank = torch.randperm(neurons, generator=g)
    return SyntheticImages(neurons, count, seed, max(1, round(side / 28)), lit, ends, rank)


def synthetic_images(
    neurons: int, count: int = SPDNN_INPUTS, total_nnz: int | None = None, seed: int = SYNTHETIC_IMAGE_SEED
) -> tuple[torch.Tensor, torch.Tensor]:
    """Binary stroke images standing in for MNIST: ``(image_index, pixel_index)`` int64, 0-based, sorted.

    See :class:`SyntheticImages` (the pixels) and :func:`synthetic_image_set` (counts and strokes).
    """
    return synthetic_image_set(neurons, count, total_nnz, seed).coordinates()
