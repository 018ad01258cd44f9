"""The ``split24`` SpMM variant: an unstructured weight as a 2:4 part plus a hypersparse residual (issue 4, large N).

At large N an unstructured SpMM is bound by the tensor cores, and a random pattern at 90-98% lets no kernel skip whole
mma tiles: the ``dense`` variant (a cuBLAS GEMM after decompressing the weight) reaches 0.70-1.00x of dense cuBLAS
(docs/PERFORMANCE.md, "Twenty-fifth session"). Hopper's sparse tensor cores double the mma rate for 2:4 weights
(Mishra et al., "Accelerating Sparse Deep Neural Networks", 2021), and a random weight at sparsity ``s`` has more than
two non-zeros in a group of 4 along K with probability ``4 s (1 - s)^3 + (1 - s)^4``: 0.37% of the groups at 90%. So
``W = W24 + R``: ``W24`` keeps the two largest-magnitude entries of every group (prunekit's cuSPARSELt binding,
compressed once), the residual ``R`` the rest, a density of about 0.1% at 90% (0.012% at 95%):

- ``"post"`` mode (the default): cuSPARSELt writes ``Y = W24 @ X^T + bias``, then the residual kernel
  (``csrc/spmm_residual.cu``) adds ``R @ X^T`` and applies the activation (rows without residual non-zeros are skipped
  when there is none);
- ``"beta"`` mode: the residual kernel writes ``Y = R @ X^T``, then cuSPARSELt computes ``Y = act(W24 @ X^T + Y +
  bias)`` reading the old ``Y`` in its epilogue (``prunekit_cslt::mm_beta``).

On the H100 at N = 2048 it ran at 0.94-1.36x of dense cuBLAS at 95 / 98% on the three large shapes, against 0.84-1.00x
for the ``dense`` variant; at 90% and on small shapes it was slower than that (docs/PERFORMANCE.md, "Twenty-ninth
session"). The price is memory: the 2:4 part holds 9/16 of the dense weight's bytes (compressed values and metadata)
beside the stored CSR weight, built on first use and kept with it. So the runtime takes it only when asked
(``$PRUNEKIT_SPMM_SPLIT24=1``, :func:`enabled`, :func:`layer_takes`). torch only, like the rest of ``kernels``.
"""

from __future__ import annotations

import os

import torch

from ..errors import KernelUnavailable
from . import gpu, structured
from .tensor_cache import tensor_version

ENABLE_ENV = "PRUNEKIT_SPMM_SPLIT24"  # "1": the runtime's eager CSR layers take split24 from MIN_N tokens
MIN_N = 2048  # the smallest N timed (issue 4's large-N targets start there)
# The layers the runtime's opt-in takes (split24-h100-2026-11-26-s29g.json, 15 points at N = 2048, in-sample): faster
# than the default CSR path ("dense") at 95% and 98% on the shapes of 4096 x 4096 and more, slower at 90% on all five
# shapes and on the two of 768 x 3072 / 3072 x 768 at every sparsity.
MAX_DENSITY = 0.055  # stored non-zeros / (M * K): 95% sparsity and beyond, with room for a random pattern's spread
MIN_ELEMENTS = 4096 * 4096  # M * K
MODES = ("beta", "post")
MODE_ENV = "PRUNEKIT_SPLIT24_MODE"
DEFAULT_MODE = "post"  # faster than "beta" at all 12 points of split24-h100-2026-11-26-s29{b,c}.json
TILE_N_ENV = "PRUNEKIT_SPLIT24_TILE_N"
SLICES_ENV = "PRUNEKIT_SPLIT24_SLICES"  # slices a warp works on at once (1 / 2)
PHASES_ENV = "PRUNEKIT_SPLIT24_PHASES"  # diagnostics: 1 stages X only, 2 runs the rows only (wrong results), 3 both
DEFAULT_SLICES = 1  # 2 was slower at all 4 points of split24-P{1,2}-h100-2026-11-26-s29f.json
_WEIGHT_ATTR = "_prunekit_split24"


def split_24(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a weight into a 2:4 part and a residual along K.

    Args:
        dense: ``(M, K)`` float tensor, ``K % 4 == 0``.

    Returns:
        ``(w24, residual)``, both ``(M, K)`` in ``dense.dtype``, ``w24 + residual == dense`` exactly: ``w24`` holds the
        two largest-magnitude entries of every group of 4 consecutive columns (either of a tie), ``residual``
        the others (non-zero only in groups with more than two non-zeros).

    Raises:
        ValueError: not 2-D, or K not a multiple of 4.
    """
    if dense.dim() != 2 or dense.shape[1] % 4:
        raise ValueError(f"split_24 needs an (M, K) weight with K a multiple of 4, got shape {tuple(dense.shape)}")
    m, k = dense.shape
    groups = dense.reshape(m, k // 4, 4)
    top = groups.abs().topk(2, dim=-1, sorted=False).indices
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, top, True)
    w24 = torch.where(keep, groups, torch.zeros((), dtype=dense.dtype, device=dense.device)).reshape(m, k)
    return w24, dense - w24


SLICE_ROWS = 32  # kSliceRows in csrc/spmm_residual.cu


def residual_sell(residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A residual's non-zeros in the SELL layout the residual kernel reads (sliced ELLPACK with slices of 32 rows,
    Kreutzer et al., "A unified sparse matrix data format for efficient general sparse matrix-vector multiplication
    on modern processors with wide SIMD units", SIAM J. Sci. Comput. 2014; here without sorting, C = 32, sigma = 1).

    Slice ``s`` (rows ``32 s .. 32 s + 31``) holds as many slots as its longest row has non-zeros, slots
    ``slice_offsets[s] .. slice_offsets[s + 1] - 1``; slot ``e``'s entry for row ``32 s + l`` is at index ``32 e + l``
    of ``values`` / ``column_indices``, the row's non-zeros in column order, then padding (value 0, column -1). A warp
    then reads one slot of its 32 rows as one coalesced load.

    Args:
        residual: ``(M, K)`` float tensor.

    Returns:
        ``(values (32 * slots,) in residual.dtype, column_indices (32 * slots,) int16 where K <= 32767 else int32,
        slice_offsets (ceil(M / 32) + 1,) int32)``.
    """
    m, k = residual.shape
    rows, cols = residual.nonzero(as_tuple=True)  # row-major order: columns ascend within a row
    slices = -(-m // SLICE_ROWS)
    counts = torch.zeros(slices * SLICE_ROWS, dtype=torch.int64, device=residual.device)
    counts[:m] = torch.bincount(rows, minlength=m)
    slots = counts.view(slices, SLICE_ROWS).amax(dim=1)
    slice_offsets = torch.zeros(slices + 1, dtype=torch.int64, device=residual.device)
    slice_offsets[1:] = slots.cumsum(0)
    total = int(slice_offsets[-1])
    row_start = torch.zeros(m + 1, dtype=torch.int64, device=residual.device)
    row_start[1:] = counts[:m].cumsum(0)
    rank = torch.arange(rows.numel(), device=residual.device) - row_start[rows]
    flat = (slice_offsets[rows // SLICE_ROWS] + rank) * SLICE_ROWS + rows % SLICE_ROWS
    index_dtype = torch.int16 if k <= torch.iinfo(torch.int16).max else torch.int32
    values = torch.zeros(total * SLICE_ROWS, dtype=residual.dtype, device=residual.device)
    column_indices = torch.full((total * SLICE_ROWS,), -1, dtype=index_dtype, device=residual.device)
    values[flat] = residual[rows, cols]
    column_indices[flat] = cols.to(index_dtype)
    return values, column_indices, slice_offsets.to(torch.int32)


def sell_to_dense(
    values: torch.Tensor, column_indices: torch.Tensor, slice_offsets: torch.Tensor, m: int, k: int
) -> torch.Tensor:
    """The ``(M, K)`` matrix a :func:`residual_sell` layout holds (float64, on its device)."""
    slots = values.numel() // SLICE_ROWS
    slot_slice = torch.searchsorted(slice_offsets[1:].long(), torch.arange(slots, device=values.device), right=True)
    rows = (slot_slice[:, None] * SLICE_ROWS + torch.arange(SLICE_ROWS, device=values.device)).reshape(-1)
    cols = column_indices.long()
    keep = cols >= 0
    dense = torch.zeros(m, k, dtype=torch.float64, device=values.device)
    dense.index_put_((rows[keep], cols[keep]), values[keep].double(), accumulate=True)
    return dense


def _residual_reference(
    values: torch.Tensor,
    column_indices: torch.Tensor,
    slice_offsets: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    n_valid: int,
    accumulate: bool,
    relu: bool,
) -> None:
    m, n = y.shape
    r = sell_to_dense(values, column_indices, slice_offsets, m, x.shape[1])
    prod = torch.zeros(m, n, dtype=torch.float64, device=y.device)
    if n_valid > 0:
        prod[:, :n_valid] = r @ x[:n_valid].double().t()
    out = prod + y.double() if accumulate else prod
    if relu:
        out = out.clamp_min(0)
    y.copy_(out.to(y.dtype))


def _define_residual_op():
    qualname = "prunekit::residual_rows"
    try:
        op = torch.library.custom_op(qualname, mutates_args=("y",), device_types="cpu")(_residual_reference)
    except RuntimeError:  # registered by another copy of this module (a package runtime and prunekit)
        return torch.ops.prunekit.residual_rows.default
    op.register_fake(lambda values, column_indices, slice_offsets, x, y, n_valid, accumulate, relu: None)

    @op.register_kernel("cuda")
    def _cuda(values, column_indices, slice_offsets, x, y, n_valid, accumulate, relu):
        residual_rows_cuda(values, column_indices, slice_offsets, x, y, n_valid, accumulate, relu)

    return op


def residual_row_parts(n: int, k: int, num_sms: int, tile_n: int | None = None) -> int:
    """Row parts of the residual kernel's grid (``blockIdx.y``): one block per ``tile_n`` tokens owns every row, so
    where those blocks are fewer than the SMs the rows are split in as many parts as fill them (each part stages the
    X tile again)."""
    tiles = -(-n // (tile_n or residual_tile_n(k)))
    return max(1, min(65535, num_sms // max(1, tiles)))


def residual_tile_n(k: int, smem_block: int = 227 * 1024, forced: int = 0) -> int:
    """Tokens per block of the residual kernel (``residual_tile_n`` in ``csrc/spmm_residual.cu``): the largest of 16 /
    8 / 4 whose X tile (``tile_n * K`` 16-bit elements) fits a block's shared memory, 0 where none does; ``forced``
    (4 / 8 / 16) takes that one where it fits. Default: the H100's 227 KB per block. A tile small enough for two blocks
    per SM was slower in add mode at all 10 points timed against it (``split24-t{8,16}-h100-2026-11-26-s29{c,e}``)."""
    if forced:
        return forced if k * forced * 2 <= smem_block else 0
    for tn in (16, 8, 4):
        if k * tn * 2 <= smem_block:
            return tn
    return 0


def _int_setting(name: str, default: int, allowed: tuple[int, ...]) -> int:
    value = os.environ.get(name, "")
    if value == "":
        return default
    if value not in tuple(str(a) for a in allowed):
        raise ValueError(f"${name} must be one of {', '.join(str(a) for a in allowed)}, got {value!r}")
    return int(value)


def slices_per_warp() -> int:
    """``$PRUNEKIT_SPLIT24_SLICES`` (1 / 2): slices of 32 rows a warp of the residual kernel works on at once.

    Raises:
        ValueError: another value.
    """
    return _int_setting(SLICES_ENV, DEFAULT_SLICES, (1, 2))


def forced_tile_n() -> int:
    """``$PRUNEKIT_SPLIT24_TILE_N`` (4 / 8 / 16) as an int, 0 (the rule) when unset.

    Raises:
        ValueError: another value.
    """
    value = os.environ.get(TILE_N_ENV, "")
    if value in ("", "0"):
        return 0
    if value not in ("4", "8", "16"):
        raise ValueError(f"${TILE_N_ENV} must be 4, 8 or 16, got {value!r}")
    return int(value)


def residual_rows_cuda(
    values: torch.Tensor,
    column_indices: torch.Tensor,
    slice_offsets: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    n_valid: int,
    accumulate: bool = False,
    relu: bool = False,
    row_parts: int | None = None,
) -> None:
    """CUDA residual product in place: ``y = act([y +] R @ x[:n_valid]^T)``, zeros for the columns from ``n_valid``.

    Args:
        values, column_indices, slice_offsets: R in the SELL layout of :func:`residual_sell` (values fp16/bf16,
            column_indices int16/int32); x: ``(N, K)`` row-major (``nn.Linear`` activations), same dtype;
            y: ``(M, N_out)`` row-major (unit stride along N), ``n_valid <= min(N, N_out)``; row_parts: the grid's row
            split (default :func:`residual_row_parts`). Tokens per block: :func:`residual_tile_n`'s rule, or
            ``$PRUNEKIT_SPLIT24_TILE_N``; slices per warp: ``$PRUNEKIT_SPLIT24_SLICES``; ``$PRUNEKIT_SPLIT24_PHASES``
            (diagnostics) runs a part of the kernel only.

    Raises:
        KernelUnavailable: no GPU/compiler. RuntimeError: bad shapes, dtypes or layouts (the kernel's checks), or K
        too large for 4 rows of X in shared memory.
    """
    gpu._ensure_loaded()
    tile_n = forced_tile_n()
    if row_parts is None:
        row_parts = residual_row_parts(y.shape[1], x.shape[1], gpu._sm_count(y.device), tile_n)
    phases = _int_setting(PHASES_ENV, 3, (1, 2, 3))
    torch.ops.prunekit_ext.spmm_residual_rows.default(
        values,
        column_indices,
        slice_offsets,
        x,
        y,
        n_valid,
        accumulate,
        relu,
        row_parts,
        tile_n,
        slices_per_warp(),
        phases,
    )


residual_rows = _define_residual_op()
"""``prunekit::residual_rows(values, column_indices, slice_offsets, x, y, n_valid, accumulate, relu) -> ()``: ``y
(M, N_out) = act([y +] R @ x[:n_valid]^T)`` in place, R in the SELL layout of :func:`residual_sell`, ``x: (N, K)``.
CPU: a float64 reference; CUDA: :func:`residual_rows_cuda`."""


def mode(value: str | None = None) -> str:
    """The ``split24`` mode (:data:`MODES`): ``value``, else ``$PRUNEKIT_SPLIT24_MODE``, else :data:`DEFAULT_MODE`.

    Raises:
        ValueError: not one of :data:`MODES`.
    """
    chosen = value if value is not None else os.environ.get(MODE_ENV, DEFAULT_MODE)
    if chosen not in MODES:
        raise ValueError(f"split24 mode must be one of {', '.join(MODES)}, got {chosen!r} (${MODE_ENV})")
    return chosen


class Split24Weight:
    """A weight as its 2:4 part (registered with prunekit's cuSPARSELt binding, compressed once) and its residual.

    Attributes: ``m``, ``k``; ``native`` (the binding's weight, ``native.id``); ``r_values`` / ``r_column_indices``
    / ``r_slice_offsets`` (the residual in the SELL layout, :func:`residual_sell`); ``residual_nnz``; ``version`` /
    ``data_ptr`` (of the stored weight it was built from).
    """

    def __init__(self, dense: torch.Tensor, version: int = 0, data_ptr: int = 0):
        m, k = dense.shape
        w24, residual = split_24(dense)
        self.m, self.k = m, k
        self.native = structured._NativeWeight(w24.contiguous(), version, data_ptr)
        self.r_values, self.r_column_indices, self.r_slice_offsets = residual_sell(residual)
        self.residual_nnz = int(residual.count_nonzero())
        self.version, self.data_ptr = version, data_ptr

    def extra_bytes(self) -> int:
        """Bytes held beside the stored weight: the 2:4 part (9/16 of the dense weight: half the values plus 2-bit
        indices) and the residual's SELL layout."""
        esize = self.r_values.element_size()
        dense = self.m * self.k * esize
        residual = sum(
            t.numel() * t.element_size() for t in (self.r_values, self.r_column_indices, self.r_slice_offsets)
        )
        return dense // 2 + dense // 16 + residual


def takes(m: int, k: int, dtype: torch.dtype) -> bool:
    """True when a weight ``(M, K)`` of ``dtype`` can run ``split24``: fp16/bf16, ``M % 32 == 0`` and ``K % 64 == 0``
    (prunekit's cuSPARSELt binding), K small enough for the residual kernel, cuSPARSELt present."""
    return (
        dtype in structured.KERNEL_DTYPES
        and m > 0
        and m % structured.CSLT_ALIGN_MK[0] == 0
        and k % structured.CSLT_ALIGN_MK[1] == 0
        and residual_tile_n(k) > 0
        and structured.native_cslt_available()
    )


def enabled(n: int) -> bool:
    """Whether ``$PRUNEKIT_SPMM_SPLIT24=1`` asks the runtime's eager CSR layers to run ``split24`` at ``n`` tokens (from
    :data:`MIN_N` on; :func:`layer_takes` then picks the layers). Off by default: it holds 9/16 of the dense weight's
    bytes per layer beside the CSR weight (docs/PERFORMANCE.md, "Twenty-ninth session")."""
    return n >= MIN_N and os.environ.get(ENABLE_ENV) == "1"


def layer_takes(values: torch.Tensor, x2d: torch.Tensor, bias: torch.Tensor | None, m: int) -> bool:
    """Whether a CSR layer's call can run ``split24`` and is one the measurements favour: ``x2d (N, K)`` in the
    weight's dtype, a bias (if any) of that dtype, contiguous, :func:`takes` for the weight ``(M, K)``, at least
    :data:`MIN_ELEMENTS` weights and a density of at most :data:`MAX_DENSITY` (non-zero ``values``; one device sync,
    made once per layer and N class by the runtime)."""
    k = x2d.shape[1]
    return (
        x2d.dtype == values.dtype
        and (bias is None or (bias.dtype == values.dtype and bias.is_contiguous() and bias.numel() == m))
        and m * k >= MIN_ELEMENTS
        and takes(m, k, values.dtype)
        and int(torch.count_nonzero(values)) <= MAX_DENSITY * m * k
    )


def split24_weight(
    values: torch.Tensor, row_offsets: torch.Tensor, column_indices: torch.Tensor, m: int, k: int
) -> Split24Weight:
    """The :class:`Split24Weight` of a stored prunekit CSR weight on the GPU, built once (decompressed with
    ``gpu.csr_to_dense``, split, the 2:4 part compressed by cuSPARSELt) and kept on ``values``; rebuilt only when
    ``values`` was modified in place or moved.

    Args:
        values: ``(nnz_padded,)`` fp16/bf16 on CUDA; row_offsets: ``(M + 1,)`` int32; column_indices: int16/int32.

    Raises:
        KernelUnavailable: no GPU, compiler or cuSPARSELt.
    """
    state = getattr(values, _WEIGHT_ATTR, None)
    if state is not None and state.version == tensor_version(values) and state.data_ptr == values.data_ptr():
        return state
    if not structured.native_cslt_available():
        raise KernelUnavailable("split24 needs prunekit's cuSPARSELt binding, which is unavailable here.")
    dense = gpu.csr_to_dense(values, row_offsets, column_indices, m, k)
    state = Split24Weight(dense, tensor_version(values), values.data_ptr())
    setattr(values, _WEIGHT_ATTR, state)
    return state


def linear(
    weight: Split24Weight,
    x2d: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    split_mode: str | None = None,
) -> torch.Tensor:
    """``act(x2d @ W^T + bias)`` through the 2:4 part and the residual (CUDA).

    Args:
        weight: from :func:`split24_weight` (or :class:`Split24Weight`); x2d: ``(N, K)`` fp16/bf16 on its GPU (copied
            to an aligned zero-padded buffer where N is not a multiple of 16 or the rows are not 16-byte aligned);
            bias: ``(M,)`` or None; activation: ``"none"`` / ``"relu"``; split_mode: :func:`mode`'s argument.

    Returns:
        ``(N, M)``: the transposed view of a row-major ``(M, N_pad)`` buffer (what cuSPARSELt's fast configuration
        writes; the 2:4 layer's ``"view"`` output).

    Raises:
        KernelUnavailable: no GPU/compiler/cuSPARSELt. ValueError: bad mode or activation. RuntimeError: bad shapes.
    """
    if activation not in ("none", "relu"):
        raise ValueError(f"split24 supports the activations none and relu, got {activation!r}")
    chosen = mode(split_mode)
    n, k = x2d.shape
    if k != weight.k:
        raise RuntimeError(f"split24: x has {k} features, the weight {weight.k}")
    n_pad = -(-n // 16) * 16
    aligned = x2d.stride(1) == 1 and x2d.stride(0) % 8 == 0 and x2d.data_ptr() % 16 == 0 and n_pad == n and n > 0
    xb = x2d if aligned else x2d.new_zeros(max(n_pad, 16), k)
    if not aligned:
        xb[:n].copy_(x2d)
    y = torch.empty(weight.m, xb.shape[0], dtype=x2d.dtype, device=x2d.device)
    relu = activation == "relu"
    r = (weight.r_values, weight.r_column_indices, weight.r_slice_offsets)
    if chosen == "beta":
        residual_rows_cuda(*r, xb, y, n, accumulate=False, relu=False)
        torch.ops.prunekit_cslt.mm_beta.default(weight.native.id, xb.t(), y, bias, relu, 1.0)
    else:
        torch.ops.prunekit_cslt.mm.default(weight.native.id, xb.t(), y, bias, False)
        residual_rows_cuda(*r, xb, y, n, accumulate=True, relu=relu)
    return y[:, :n].t()


def reference(
    dense: torch.Tensor, x2d: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "none"
) -> torch.Tensor:
    """float64 reference of :func:`linear`: ``act(x2d @ dense^T + bias)``, ``(N, M)`` float64."""
    y = x2d.double() @ dense.double().t()
    if bias is not None:
        y = y + bias.double()
    return y.clamp_min(0) if activation == "relu" else y
