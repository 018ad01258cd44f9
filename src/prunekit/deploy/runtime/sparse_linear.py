"""SparseLinear: an ``nn.Linear`` whose weight stays in a sparse storage format.

The forward pass computes ``y = x @ W^T + b`` with ``x: (..., in_features)`` through the
format's matmul op (``prunekit::spmm_csr``, ``bsr_mm``, ``nm_mm``; CPU reference or CUDA
kernels), as ``Y^T = W @ X^T`` on a transposed view. Storage-only formats (``bitmask``) and
``dense`` decode to a dense weight and use ``F.linear``.

Eager calls on CUDA skip the custom-op layers: BSR and 2:4 layers call one C++ operator each
(``prunekit_structured::bsr_mm``; for 2:4 ``prunekit_nm24::spmv24`` on the stored format at N = 1,
``prunekit_nm24::linear`` at N <= 16, else ``prunekit_cslt::linear``)
that allocates the output and launches
the kernel, with the per-layer decisions (kernel or reference, variant, output layout) made on the
first call and cached per dtype (BSR: per dtype and N class). CSR layers run what the op's CUDA implementation
``gpu.spmm_csr_op`` runs: the bitmap decode kernel's C++ entry ``prunekit_nm24::bitmap_linear`` at the N where
``"auto"`` takes it, else ``prunekit_ext::spmm_csr_auto`` where ``gpu.eager_spmm_variant`` allows, else
``gpu.spmm_csr``, decided once per weight, dtype and N (kept with the weight's values), with the entry and its plan kept
on the layer (``gpu.spmm_rows_call``); with ``$PRUNEKIT_SPMM_SPLIT24=1``, from N = 2048 the ``split24`` variant
(``kernels/split24.py``: a 2:4 part through cuSPARSELt plus a hypersparse residual). At decode sizes these operators
take the activations ``(N, K)`` as given and
return ``Y^T (N, M)`` (a ``ROWS`` flag; the transposes are made in C++): at small N the host time of an eager call,
not the kernel, sets what a user sees (docs/PERFORMANCE_STRUCTURED.md, "Twentieth session"). Traced, compiled and
CPU calls, and inputs that need a gradient, go through the custom ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...formats import EncodedTensor, decode
from ...kernels import gpu, nm24, ops, split24, structured
from ...kernels.tensor_cache import stamp as tensor_stamp


def _csr(layer: SparseLinear, xt: torch.Tensor) -> torch.Tensor:
    # Traced, compiled and CPU calls, and an input that needs a gradient, go through the differentiable custom op.
    # (Eager CUDA inference was taken in forward by _csr_rows: prunekit::spmm_csr's CUDA implementation, its C++ entry
    # called directly where one applies, skipping the custom-op dispatch.)
    b = layer._buffers  # the dict itself: four Module.__getattr__ calls cost microseconds per eager call
    args = (b["w_values"], b["w_row_offsets"], b["w_column_indices"], b["w_row_indices"], xt, layer.out_features)
    return ops.spmm_csr(*args, layer.bias)


def _bias(layer: SparseLinear) -> torch.Tensor | None:
    """``layer.bias`` without ``Module.__getattr__`` (microseconds per eager call): a bias given at construction is a
    registered parameter; one assigned later to a layer built without it is a plain attribute."""
    bias = layer._parameters.get("bias")
    return bias if bias is not None else layer.__dict__.get("bias")


def _eager_cuda(xt: torch.Tensor) -> bool:
    """True for an eager call on the GPU: the runtime then calls the CUDA implementation directly, skipping the
    custom-op dispatch layers (tens of microseconds per call); traced/compiled calls keep going through the op."""
    return xt.is_cuda and not torch.compiler.is_compiling()


def _bsr(layer: SparseLinear, xt: torch.Tensor) -> torch.Tensor:
    c = layer.component
    static = "schedule" in layer._names  # static mode: the load-balanced schedule stored at export (formats/bsr.py)
    if _eager_cuda(xt):  # what _bsr_rows left: the Python launcher (reference shapes and dtypes, C++ entries off)
        buffers = layer._buffers
        sched = structured.decode_schedule(
            buffers["w_blocks"], buffers["w_crow_indices"], buffers.get("w_schedule"), buffers.get("w_split_rows"),
            xt.shape[1],
        )  # fmt: skip
        return structured.bsr_mm_cuda(
            c("blocks"), c("crow_indices"), c("col_indices"), xt, layer.out_features, layer.bias, "none", *sched
        )
    if static:
        return structured.bsr_mm_static(
            c("blocks"),
            c("crow_indices"),
            c("col_indices"),
            c("schedule"),
            c("split_rows"),
            xt,
            layer.out_features,
            layer.bias,
        )
    return ops.bsr_mm(c("blocks"), c("crow_indices"), c("col_indices"), xt, layer.out_features, layer.bias)


def _bsr_rows(layer: SparseLinear, x2d: torch.Tensor) -> torch.Tensor | None:
    """Eager CUDA BSR: ``Y^T (N, out_features)`` from ``x2d (N, in_features)`` in one call of the C++ entry
    ``prunekit_structured::bsr_mm`` with :data:`structured.ROWS` (the transposes made in C++), or None where that entry
    does not take the layer (the generic path then runs). What the call runs is decided on the first call per x dtype,
    weight dtype and N class (each N up to ``structured.DECODE_MAX_N``, then :func:`structured.split_n_class`) and
    kept on the layer: the variant, and whether static mode takes
    :func:`structured.decode_schedule`'s finer schedule or the stored items unsplit (:func:`structured.split_pays`).
    So ``$PRUNEKIT_BSR_DECODE_SCHEDULE``, ``$PRUNEKIT_BSR_LEAN`` and ``$PRUNEKIT_BSR_SPLIT`` are read by Python on that
    first call; the kernel still reads ``$PRUNEKIT_BSR_LEAN`` on every call. The op itself is kept too; calls the lean
    kernel takes pass no schedule. Each call then costs a dictionary lookup in Python besides the op call: the layer's
    host time per call is the eager overhead that issue 5 bounds."""
    buffers = layer._buffers
    blocks = buffers["w_blocks"]
    n = x2d.shape[0]
    # N classes: each N up to DECODE_MAX_N, then split_pays' classes (0, -1, -2 ...)
    key = (x2d.dtype, blocks.dtype, n if n <= structured.DECODE_MAX_N else -structured.split_n_class(n))
    crow = buffers["w_crow_indices"]
    entry = layer._eager_plans.get(key, _UNSET)
    if entry is _UNSET:
        variant = structured.eager_bsr_variant(blocks, x2d.t())
        if variant is None:
            entry = None
        else:
            static = buffers.get("w_schedule") is not None
            # 0: the stored schedule; 1: decode_schedule's finer one; 2: none, for the lean kernel (it reads none, and
            # two arguments fewer cost less host time; were $PRUNEKIT_BSR_LEAN=0 set later, the tiled kernel would run
            # in dynamic mode, which is as correct); 3: the stored items unsplit, where its split rows do not pay
            # a wgmma call keeps the stored schedule (an unresolved "auto" is 16-row blocks: never the finer one)
            wgmma = variant == structured.VARIANTS["wgmma"]
            split = buffers.get("w_split_rows")
            if structured.lean_takes(blocks, n):
                sched = 2
            elif static and structured.finer_decode_schedule(blocks, n, wgmma):
                sched = 1
            elif static and split is not None and split.numel() and not structured.split_pays(blocks, crow, n):
                sched = 3
            else:
                sched = 0
            entry = (structured.bsr_mm_entry(), variant | structured.ROWS, sched)
        layer._eager_plans[key] = entry
    if entry is None:
        return None
    op, variant, sched = entry
    bias = _bias(layer)
    if sched == 2:
        return op(blocks, crow, buffers["w_col_indices"], None, None, x2d, layer.out_features, bias, False, variant)
    if sched == 1:  # static mode at a decode N the lean kernel does not take: the finer schedule, kept on crow_indices
        items, rows = structured.decode_schedule(blocks, crow, buffers["w_schedule"], buffers["w_split_rows"], n)
    elif sched == 3:  # static mode where the stored split rows cost more than they balance: unsplit, kept on crow
        items, rows = structured.unsplit_schedule(crow)
    else:
        items, rows = buffers.get("w_schedule"), buffers.get("w_split_rows")
    return op(blocks, crow, buffers["w_col_indices"], items, rows, x2d, layer.out_features, bias, False, variant)


_SPLIT24_CLASS = -100  # _csr_rows's key for the split24 calls, beside the negated gpu.eager_size_class above 256


def _csr_rows(layer: SparseLinear, x2d: torch.Tensor) -> torch.Tensor:
    """Eager CUDA CSR: ``Y^T (N, out_features)`` from ``x2d (N, in_features)``, what ``gpu.spmm_csr_op`` computes from
    ``x2d.t()``. Its parts (``gpu.spmm_rows_call``: the C++ entry and its plan or variant code) are kept per x dtype, bias
    dtype and N (N's size class above ``gpu.BITMAP_WIDE_MAX_N``, as ``gpu.spmm_op_entry`` keys its decisions) with the
    data pointers and versions of the weight they were made for, so a call costs one dictionary lookup and one stamp
    besides the op call; where there are none, ``gpu.spmm_csr`` (the Python launcher) runs the call."""
    b = layer._buffers
    values, offsets, cols, rows = b["w_values"], b["w_row_offsets"], b["w_column_indices"], b["w_row_indices"]
    bias = _bias(layer)
    n = x2d.shape[0]
    split = n > gpu.BITMAP_WIDE_MAX_N and split24.enabled(n)  # opt-in: $PRUNEKIT_SPMM_SPLIT24=1
    key = (
        x2d.dtype,
        None if bias is None else bias.dtype,
        n if n <= gpu.BITMAP_WIDE_MAX_N else _SPLIT24_CLASS if split else -gpu.eager_size_class(n),
    )
    entry = layer._eager_plans.get(key, _UNSET)
    try:  # the stamp of the weight the parts were made for, written out: this runs on every eager call
        now = (values.data_ptr(), values._version, cols.data_ptr(), cols._version, offsets.data_ptr(), offsets._version)
    except RuntimeError:  # inference tensors keep no version counter (tensor_cache.tensor_version)
        now = sum(tensor_stamp((values, cols, offsets)), ())
    if entry is _UNSET or entry[0] != now:
        call = None
        if split and split24.layer_takes(values, x2d, bias, layer.out_features):
            # the split24 variant: the weight's 2:4 part (built once, kept on values) and its residual
            call = (2, split24.split24_weight(values, offsets, cols, layer.out_features, layer.in_features))
        if call is None:
            call = gpu.spmm_rows_call(values, offsets, cols, rows, x2d, layer.out_features, bias)
        entry = (now, call)
        layer._eager_plans[key] = entry
    call = entry[1]
    if call is None:
        return gpu.spmm_csr(values, offsets, cols, rows, x2d.t(), layer.out_features, bias).t()
    if call[0] == 2:  # split24 (an int marker beside the bitmap flag True / False below)
        return split24.linear(call[1], x2d, bias)
    if call[0]:  # the bitmap entry
        return call[1](call[2], x2d, bias, False, call[3], call[4])
    return call[1](values, offsets, cols, rows, x2d, layer.out_features, bias, False, call[2])


def _nm_decode_takes(layer: SparseLinear, x2d: torch.Tensor) -> bool:
    """Whether the 2:4 decode kernels take this layer at ``x2d``'s N: its bias as the kernels read it (x's dtype,
    contiguous), :func:`nm24.decode_takes` and the library loads."""
    bias, p = layer.bias, layer.params
    bias_ok = bias is None or (bias.dtype == x2d.dtype and bias.is_contiguous())
    return (
        bias_ok
        and nm24.decode_takes(layer._buffers["w_values"], x2d.t(), int(p["n"]), int(p["m"]))
        and nm24.available()
    )


def _nm_decode(layer: SparseLinear, x2d: torch.Tensor) -> torch.Tensor | None:
    """Eager CUDA 2:4 at decode sizes: ``Y^T (N, out_features)`` from ``x2d (N, in_features)`` in one call of
    prunekit's 2:4 decode kernel (what ``nm24.linear`` with ``rows`` does: no transposes in Python), or None where it
    does not apply (the generic path then runs). Decided once per layer and dtype, and kept with the data pointers and
    versions of the weight it was built from: the C++ entry (``nm24.linear_entry``), the plan's buffer and its settings
    with ``nm24.ROWS``, so that a call costs one dictionary lookup and one stamp besides the op call."""
    n = x2d.shape[0]
    if not (0 < n <= nm24.MAX_N and _eager_cuda(x2d)):
        return None
    buffers = layer._buffers
    values, metadata = buffers["w_values"], buffers["w_metadata"]
    if n == 1:  # one token: the SpMV kernel on the stored format where it applies (no plan)
        key = (x2d.dtype, values.dtype, "spmv")
        stamp = (values.data_ptr(), metadata.data_ptr())
        entry = layer._eager_plans.get(key)
        if entry is None or entry[0] != stamp:
            takes = _nm_decode_takes(layer, x2d) and nm24.spmv_takes(values, metadata, x2d, int(layer.params["bits"]))
            entry = layer._eager_plans[key] = (stamp, nm24.spmv_entry() if takes else None)
        if entry[1] is not None:  # nm24.spmv(values, metadata, x2d, bias, rows=True) without its wrapper
            return entry[1](values, metadata, x2d, _bias(layer), False, True)
    key = (x2d.dtype, values.dtype, "decode")
    entry = layer._eager_plans.get(key, _UNSET)
    try:  # the stamp of the weight the plan was built from, written out: this runs on every eager call
        now = (values.data_ptr(), values._version, metadata.data_ptr(), metadata._version)
    except RuntimeError:  # inference tensors keep no version counter (tensor_cache.tensor_version)
        now = sum(tensor_stamp((values, metadata)), ())
    if entry is _UNSET or (entry is not None and entry[0] != now):
        entry = None
        if _nm_decode_takes(layer, x2d):
            plan = nm24.get_plan(values, metadata, int(layer.params["bits"]), layer.in_features)
            # nm24.linear(plan, x2d, bias, rows=True), its parts kept: the C++ entry, the plan's buffer, its settings
            entry = (now, nm24.linear_entry(), plan.buffer, plan.cfg | nm24.ROWS)
        layer._eager_plans[key] = entry
    if entry is None:
        return None
    return entry[1](entry[2], x2d, _bias(layer), False, entry[3])


def _nm(layer: SparseLinear, xt: torch.Tensor) -> torch.Tensor:
    c, p = layer.component, layer.params
    if _eager_cuda(xt) and xt.shape[1] > 0:  # decode sizes were taken by _nm_decode when its kernel applies
        buffers = layer._buffers
        values = buffers["w_values"]
        key = (xt.dtype, values.dtype)
        output = layer._eager_plans.get(key, _UNSET)
        if output is _UNSET:
            output = layer._eager_plans[key] = structured.eager_nm24_output(values, xt, int(p["n"]), int(p["m"]))
        if output is not None:  # structured.CSLT_OUTPUTS: by default "view", a non-contiguous layer output
            weight = structured.native_weight_24(values, buffers["w_metadata"], int(p["bits"]), layer.in_features)
            try:
                return torch.ops.prunekit_cslt.linear.default(weight.id, xt, layer.bias, False, output)
            except RuntimeError:  # a cuSPARSELt error: nm_mm_cuda reports it and switches to torch's path for good
                layer._eager_plans[key] = None
    matmul = structured.nm_mm_cuda if _eager_cuda(xt) else ops.nm_mm
    return matmul(c("values"), c("metadata"), xt, int(p["n"]), int(p["m"]), int(p["bits"]), layer.bias)


def _ks(layer: SparseLinear, xt: torch.Tensor) -> torch.Tensor:
    from ...formats.ks import factor_blocks
    from ...kernels import ks

    return ks.ks_chain_mm(factor_blocks(layer.encoded()), xt, layer.bias)


_UNSET = object()  # no eager plan cached yet for this key

# Format name -> matmul computing Y^T (out_features, tokens) from X^T (in_features, tokens).
SPARSE_MATMULS = {"csr": _csr, "bsr": _bsr, "nm": _nm, "ks": _ks}


class SparseLinear(nn.Module):
    """Linear layer over an :class:`EncodedTensor` weight ``(out_features, in_features)``.

    Args:
        encoded: the weight in any registered format.
        bias: ``(out_features,)`` or None.
    """

    def __init__(self, encoded: EncodedTensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.format = encoded.format
        self.params = dict(encoded.params)
        self.dtype_name = encoded.dtype
        self.out_features, self.in_features = int(encoded.shape[0]), int(encoded.shape[1])
        self._names = list(encoded.components)
        for name, tensor in encoded.components.items():
            self.register_buffer(f"w_{name}", tensor)
        if bias is not None:
            self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        else:
            self.bias = None
        self._eager_plans: dict[tuple, object] = {}  # (x dtype, weight dtype[, path]) -> plan

    def component(self, name: str) -> torch.Tensor:
        return getattr(self, f"w_{name}")

    def encoded(self) -> EncodedTensor:
        """The weight as an :class:`EncodedTensor` (current device and dtype)."""
        comps = {n: self.component(n) for n in self._names}
        dtype = comps.get("values", comps.get("blocks", comps.get("compressed", comps.get("weight")))).dtype
        return EncodedTensor(
            self.format, (self.out_features, self.in_features), str(dtype).removeprefix("torch."), self.params, comps
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.dim() == 2  # (tokens, in_features) as given: no reshapes, a few microseconds less per eager call
        x2d = x if flat else x.reshape(-1, self.in_features)
        y = None
        if self.format == "nm":
            y = _nm_decode(self, x2d)
        elif _eager_cuda(x2d):  # the C++ entries take the activations (N, K) and give Y^T (N, M) as they are
            if self.format == "bsr":
                y = _bsr_rows(self, x2d)
            elif self.format == "csr" and not (x2d.requires_grad and torch.is_grad_enabled()):
                y = _csr_rows(self, x2d)
        if y is not None:
            return y if flat else y.reshape(*x.shape[:-1], self.out_features)
        matmul = SPARSE_MATMULS.get(self.format)
        if matmul is None:
            y = F.linear(x2d, decode(self.encoded()).to(x.dtype), self.bias)
        else:
            y = matmul(self, x2d.t()).t()
        return y if flat else y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}, bias={self.bias is not None}"
