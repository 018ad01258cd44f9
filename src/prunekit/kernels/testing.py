"""Helpers shared by the kernel tests, ``prunekit kernels check`` and the benchmarks: random sparse weights, a
device-side CSR encoder, the error metric against a float64 reference, and a scoped environment switch (the kernels'
``$PRUNEKIT_*`` switches are read at each call). torch only.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from ..formats.csr import csr_layout, csr_rows

# ||out - ref|| / ||ref|| bounds for outputs rounded to each dtype from an fp32 accumulator (fp16 rounds at 2^-11,
# bf16 at 2^-8; the norm-wise error sits well under one rounding unit).
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}


def random_sparse_weight(
    m: int,
    k: int,
    sparsity: float,
    dtype: torch.dtype = torch.float16,
    device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
    empty_rows: int = 0,
    single_rows: int = 0,
) -> torch.Tensor:
    """Dense ``(m, k)`` weight with i.i.d. N(0, 1) entries, each zeroed with probability ``sparsity``.

    The first ``empty_rows`` rows are all zero and the next ``single_rows`` rows keep exactly one non-zero (edge cases
    for the kernels: empty rows and rows shorter than one vector).
    """
    w = torch.randn(m, k, generator=generator, device=device)
    keep = torch.rand(m, k, generator=generator, device=device) >= sparsity
    w = torch.where(keep & (w != 0), w, torch.zeros((), device=device))
    w[:empty_rows] = 0
    for r in range(empty_rows, min(m, empty_rows + single_rows)):
        w[r] = 0
        if k:
            col = int(torch.randint(k, (1,), generator=generator, device=device))
            w[r, col] = 1.0 + r / max(1, m)
    w = w.to(dtype)
    return torch.where(w != 0, w, torch.zeros((), dtype=dtype, device=device))


def random_block_sparse_weight(
    m: int,
    k: int,
    r: int,
    c: int,
    density: float,
    dtype: torch.dtype = torch.float16,
    device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Dense ``(m, k)`` weight whose ``r x c`` blocks are kept with probability ``density`` (N(0, 1) entries inside).

    Edge cases for the BSR kernels: block row 0 is empty, block row 1 (when there is one) keeps exactly one block, and
    block row 2 (when there is one) keeps every block, so a static schedule with small items splits it.

    Raises:
        ValueError: ``m`` or ``k`` not a multiple of ``r`` / ``c``.
    """
    if m % r or k % c:
        raise ValueError(f"a ({m}, {k}) weight does not split into {r}x{c} blocks")
    keep = torch.rand(m // r, k // c, generator=generator, device=device) < density
    keep[0] = False
    if m // r > 1:
        keep[1] = False
        keep[1, int(torch.randint(k // c, (1,), generator=generator, device=device))] = True
    if m // r > 2:
        keep[2] = True
    mask = keep.repeat_interleave(r, 0).repeat_interleave(c, 1)
    return (torch.randn(m, k, generator=generator, device=device) * mask).to(dtype)


# (M, K, sparsity, empty_rows) edge cases shared by the kernel tests, each pairing them with N values of its own: M = 1,
# M not a multiple of 8 / 16, K not a multiple of 4 / 8 / 16 / 128 / 256, several chunks or groups, 20 empty rows (a
# whole empty window or strip), dense, very sparse (empty segments or groups).
SPMM_EDGE_CASES = (
    (1, 7, 0.5, 0),
    (1, 300, 0.9, 0),
    (33, 45, 0.7, 2),
    (77, 203, 0.8, 2),
    (130, 301, 0.9, 20),
    (64, 1031, 0.95, 2),
    (40, 520, 0.98, 3),
    (257, 64, 0.0, 2),
    (19, 777, 0.7, 2),
)


def random_spmm_case(
    m: int, k: int, n: int, sparsity: float, empty_rows: int, dtype: torch.dtype, seed: int, device: str = "cpu"
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """A seeded SpMM test case: ``(dense (M, K), its CSR components, x2d (N, K), bias (M,))`` in ``dtype``, with up
    to ``empty_rows`` empty rows and two 1-nnz rows (both capped at M - 1)."""
    g = torch.Generator(device=device).manual_seed(seed)
    dense = random_sparse_weight(
        m, k, sparsity, dtype, device, g, empty_rows=min(empty_rows, m - 1), single_rows=min(2, m - 1)
    )
    x2d = torch.randn(n, k, generator=g, device=device).to(dtype)
    bias = torch.randn(m, generator=g, device=device).to(dtype)
    return dense, encode_csr(dense), x2d, bias


def encode_csr(dense: torch.Tensor) -> dict[str, torch.Tensor]:
    """prunekit CSR components of ``dense: (M, K)`` computed on ``dense``'s device (CUDA for large weights).

    Gives exactly the components of ``prunekit.formats.encode("csr", dense)`` (which runs on the CPU): values padded
    per row to 16 bytes, padding repeating the row's last column, int16/int32 column indices, int32 row offsets and
    the row swizzle (rows by non-zeros, longest first, stable).
    """
    m, k = dense.shape
    rows, cols = torch.nonzero(dense != 0, as_tuple=True)  # row-major
    index, slots = csr_layout(rows, cols, m, k, dense.dtype)
    values = torch.zeros(int(index["row_offsets"][-1]), dtype=dense.dtype, device=dense.device)
    values[slots] = dense[rows, cols]
    return {"values": values, **index}


def rerun_chain(chain, x0: torch.Tensor, graph: bool) -> None:
    """Run ``chain()`` (kernel launches that read ``x0`` and each other's outputs, no synchronisation between them) once,
    then again: with ``graph`` captured in a CUDA graph and replayed after ``x0`` got fresh N(0, 1) values, else eagerly.
    Synchronises after each run. For tests of kernels that may start before the preceding kernel has finished
    (programmatic dependent launch): the caller then checks every output against float64 on the input it was given."""
    chain()
    torch.cuda.synchronize()
    if graph:
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            chain()
        x0.copy_(torch.randn_like(x0))
        cuda_graph.replay()
    else:
        chain()
    torch.cuda.synchronize()


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (``||out||`` when ``ref`` is all zeros); NaN/inf give ``inf``."""
    o = out.detach().double().cpu()
    r = ref.detach().double().cpu()
    if not torch.isfinite(o).all():
        return float("inf")
    den = r.norm()
    num = (o - r).norm()
    return float(num / den) if den > 0 else float(num)


def spmm_reference64(dense: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    """float64 ``act(dense @ x + bias[:, None])`` on the CPU: the oracle for SpMM outputs."""
    y = dense.double().cpu() @ x.double().cpu()
    if bias is not None:
        y = y + bias.double().cpu()[:, None]
    return torch.relu(y) if activation == "relu" else y


def sddmm_reference64(dense_pattern: dict[str, torch.Tensor], a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float64 SDDMM oracle for the CSR components ``dense_pattern`` (padding entries 0), on the CPU."""
    from .reference import csr_padding_mask

    ro = dense_pattern["row_offsets"].cpu()
    ci = dense_pattern["column_indices"].cpu()
    rows = csr_rows(ro)
    out = (a.double().cpu()[rows] * b.double().cpu()[ci.long()]).sum(-1)
    out[csr_padding_mask(ro, ci)] = 0
    return out


@contextlib.contextmanager
def env_setting(name: str, value: str | None) -> Iterator[None]:
    """``os.environ[name] = value`` (``None``: unset) inside the block; the previous state is restored after it, also
    when the block raises."""
    previous = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def prunekit_settings() -> dict[str, str]:
    """The ``PRUNEKIT_*`` environment variables of this process (name -> value, sorted): what a benchmark records in
    its result file's meta so that a run with a kernel switch set can be told from one without."""
    return {key: value for key, value in sorted(os.environ.items()) if key.startswith("PRUNEKIT_")}
