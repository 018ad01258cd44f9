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
first call and cached per dtype. CSR layers at the N where ``"auto"`` takes the bitmap decode kernel call its C++
entry ``prunekit_nm24::bitmap_linear``; otherwise ``prunekit_ext::spmm_csr_auto`` where
``gpu.eager_spmm_variant`` allows, else the op's CUDA implementation ``gpu.spmm_csr`` directly. Traced,
compiled and CPU calls, and inputs that need a gradient, go through the custom ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...formats import EncodedTensor, decode
from ...kernels import gpu, nm24, ops, structured
from ...kernels.tensor_cache import tensor_version


def _csr_decode(layer: SparseLinear, x2d: torch.Tensor) -> torch.Tensor | None:
    """Eager CUDA CSR at the N (2 to ``gpu.BITMAP_WIDE_MAX_N``) where ``"auto"`` takes the bitmap kernel: ``Y^T (N, out_features)`` from ``x2d
    (N, in_features)`` in one call of its C++ entry (``gpu.bitmap_linear``: no transposes or plan lookups in Python),
    or None where it does not apply (the generic path then runs). Decided once per layer, dtype and N (the rule's
    density floor depends on N); the plan is kept with the data pointers and versions of the weight it was built from.
    """
    n = x2d.shape[0]
    if not (gpu.BITMAP_MIN_N <= n <= gpu.BITMAP_WIDE_MAX_N and _eager_cuda(x2d)):
        return None
    if x2d.requires_grad and torch.is_grad_enabled():
        return None  # the differentiable custom op
    buffers = layer._buffers
    values, cols, offsets = buffers["w_values"], buffers["w_column_indices"], buffers["w_row_offsets"]
    key = (x2d.dtype, values.dtype, "bitmap", n)
    entry = layer._eager_plans.get(key, _UNSET)
    stamp = (values.data_ptr(), tensor_version(values), cols.data_ptr(), tensor_version(cols))
    if entry is _UNSET or (entry is not None and entry[0] != stamp):
        m, k = layer.out_features, layer.in_features
        ok = gpu.eager_bitmap_takes(values, x2d, m, k, layer.bias)
        entry = (stamp, gpu.bitmap_linear_plan((values, offsets, cols), m, k, x2d.device, n=n)) if ok else None
        layer._eager_plans[key] = entry
    return None if entry is None else gpu.bitmap_linear(entry[1], x2d, layer.bias)


def _csr(layer: SparseLinear, xt: torch.Tensor) -> torch.Tensor:
    # Eager CUDA inference: one C++ operator call (prunekit_ext::spmm_csr_auto) when gpu.eager_spmm_variant allows,
    # else gpu.spmm_csr; an input that needs a gradient keeps the differentiable custom op.
    if _eager_cuda(xt) and not (xt.requires_grad and torch.is_grad_enabled()):
        buffers = layer._buffers
        values = buffers["w_values"]
        # The decision depends on N only through its size class (gpu.eager_size_class: where a tensor-core plan is possible).
        key = (xt.dtype, values.dtype, gpu.eager_size_class(xt.shape[1]))
        code = layer._eager_plans.get(key, _UNSET)
        if code is _UNSET:
            code = layer._eager_plans[key] = gpu.eager_spmm_variant(values, xt, m=layer.out_features)
        args = (
            values,
            buffers["w_row_offsets"],
            buffers["w_column_indices"],
            buffers["w_row_indices"],
            xt,
            layer.out_features,
            layer.bias,
        )
        if code is not None:
            return torch.ops.prunekit_ext.spmm_csr_auto.default(*args, False, code)
        # No C++ entry for this call (a tensor-core plan, or the entry off): the op's CUDA implementation, called
        # directly, skips the custom-op dispatch (29.9 against 18.5 us per call on the H100 host, docs/PERFORMANCE.md).
        return gpu.spmm_csr(*args)
    c = layer.component
    return ops.spmm_csr(
        c("values"), c("row_offsets"), c("column_indices"), c("row_indices"), xt, layer.out_features, layer.bias
    )


def _eager_cuda(xt: torch.Tensor) -> bool:
    """True for an eager call on the GPU: the runtime then calls the CUDA implementation directly, skipping the
    custom-op dispatch layers (tens of microseconds per call); traced/compiled calls keep going through the op."""
    return xt.is_cuda and not torch.compiler.is_compiling()


def _bsr(layer: SparseLinear, xt: torch.Tensor) -> torch.Tensor:
    c = layer.component
    static = "schedule" in layer._names  # static mode: the load-balanced schedule stored at export (formats/bsr.py)
    if _eager_cuda(xt):
        buffers = layer._buffers
        key = (xt.dtype, buffers["w_blocks"].dtype)
        plan = layer._eager_plans.get(key, _UNSET)
        if plan is _UNSET:
            plan = layer._eager_plans[key] = structured.eager_bsr_variant(buffers["w_blocks"], xt)
        if plan is not None:
            return torch.ops.prunekit_structured.bsr_mm.default(
                buffers["w_blocks"],
                buffers["w_crow_indices"],
                buffers["w_col_indices"],
                buffers.get("w_schedule"),
                buffers.get("w_split_rows"),
                xt,
                layer.out_features,
                layer.bias,
                False,
                plan,
            )
        sched = (c("schedule"), c("split_rows")) if static else (None, None)
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
    prunekit's 2:4 decode kernel (``nm24.linear`` with ``rows``: no transposes in Python), or None where it does not
    apply (the generic path then runs). Decided once per layer and dtype; the kernel's plan is kept with the data
    pointers and versions of the weight it was built from."""
    if not (0 < x2d.shape[0] <= nm24.MAX_N and _eager_cuda(x2d)):
        return None
    buffers = layer._buffers
    values, metadata = buffers["w_values"], buffers["w_metadata"]
    if x2d.shape[0] == 1:  # one token: the SpMV kernel on the stored format where it applies (no plan)
        key = (x2d.dtype, values.dtype, "spmv")
        stamp = (values.data_ptr(), metadata.data_ptr())
        entry = layer._eager_plans.get(key)
        if entry is None or entry[0] != stamp:
            takes = _nm_decode_takes(layer, x2d) and nm24.spmv_takes(values, metadata, x2d, int(layer.params["bits"]))
            entry = layer._eager_plans[key] = (stamp, takes)
        if entry[1]:
            return nm24.spmv(values, metadata, x2d, layer.bias, rows=True)
    key = (x2d.dtype, values.dtype, "decode")
    entry = layer._eager_plans.get(key, _UNSET)
    stamp = (values.data_ptr(), tensor_version(values), metadata.data_ptr(), tensor_version(metadata))
    if entry is _UNSET or (entry is not None and entry[0] != stamp):
        ok = _nm_decode_takes(layer, x2d)
        entry = (stamp, nm24.get_plan(values, metadata, int(layer.params["bits"]), layer.in_features)) if ok else None
        layer._eager_plans[key] = entry
    return None if entry is None else nm24.linear(entry[1], x2d, layer.bias, rows=True)


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
        decode_call = _nm_decode if self.format == "nm" else _csr_decode if self.format == "csr" else None
        if decode_call is not None:
            y = decode_call(self, x2d)
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
