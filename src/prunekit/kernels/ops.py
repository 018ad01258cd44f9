"""prunekit's torch.library custom ops: ``prunekit::spmm_csr``, ``prunekit::sddmm_csr``, ``prunekit::csr_to_dense``,
``prunekit::bsr_mm``, ``prunekit::nm_mm``.

Each op has a CPU implementation (the pure-torch reference in ``reference.py``) and a fake
(meta) implementation, so it runs eagerly, under ``torch.compile`` and in ``torch.export``.
``spmm_csr``, ``sddmm_csr`` and ``csr_to_dense`` also have CUDA implementations (``gpu.py``), which build or load
the extension on first use and raise ``KernelUnavailable`` when they cannot. The ``split24`` variant's residual op,
``prunekit::residual_rows``, is registered by ``split24.py`` (imported below), ``prunekit::ks_mm`` by ``ks.py``.
torch only: this package is copied into every exported package's ``runtime/``.

Eager calls: ``spmm_csr``, ``sddmm_csr``, ``csr_to_dense``, ``bsr_mm``, ``nm_mm`` and ``structured.bsr_mm_static``
run their CUDA implementation directly where :func:`eager_direct` allows it (plain CUDA tensors, no gradient to record,
nothing tracing or intercepting the call), skipping the custom-op layers' host time; everywhere else (CPU, autograd,
``torch.compile``, ``torch.export``, modes, profiling) they go through the registered op as before.
"""

from __future__ import annotations

import functools

import torch

from . import reference
from .layout import as_spmm_output, new_spmm_output

__all__ = ["spmm_csr", "sddmm_csr", "csr_to_dense", "bsr_mm", "nm_mm", "eager_direct"]


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # eager_direct's tensor types (a Parameter dispatches as a plain tensor)
# torch's private probes eager_direct asks (present from torch 2.1 at least); where one is missing, no call is direct
_TORCH_FUNCTION_MODES = getattr(torch._C, "_len_torch_function_stack", None)
_DISPATCH_MODES = getattr(torch._C, "_len_torch_dispatch_stack", None)
_FUNCTORCH_LEVEL = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
_PROFILER_ON = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", None)
# torch.jit.is_tracing() outside TorchScript: its torch._C probe without the wrapper's scripting check (eager Python is
# never scripted); torch.compiler.is_compiling: the same function object, which dynamo folds to True when it traces
_IS_TRACING = getattr(torch._C, "_is_tracing", None)
_IS_COMPILING = torch.compiler.is_compiling
_DIRECT_PROBES = None not in (_TORCH_FUNCTION_MODES, _DISPATCH_MODES, _FUNCTORCH_LEVEL, _PROFILER_ON, _IS_TRACING)


def eager_direct(x: torch.Tensor, *tensors: torch.Tensor | None, device_type: str = "cuda") -> bool:
    """Whether a call of a prunekit op may run the op's CUDA implementation directly instead of going through the
    custom-op layers (``torch.library.custom_op``'s Python autograd kernel, the dispatcher and the Python kernel
    wrapper: most of an eager op call's host time at small sizes). The result and the errors are the same; what a direct
    call leaves out is what those layers add, so it is taken only where they would add nothing:

    - ``x`` is a plain ``torch.Tensor`` or ``nn.Parameter`` (no other subclass: no fake or functional tensors) on
      ``device_type``, and so is every other tensor given (None is skipped);
    - no tensor requires a gradient while grad mode is on (the op's autograd records the call otherwise);
    - nothing intercepts the call: not compiling or exporting (``torch.compiler.is_compiling``), not ``torch.jit``
      tracing, no torch-function or dispatch mode active (``torch.device`` contexts, FlopCounterMode, proxy tracing),
      no functorch transform (``vmap``, ``grad``), and no profiler running (it keeps the op's name in its trace).

    Args:
        x: the op's dense operand; tensors: its other tensor arguments (any may be None); device_type: the device
            whose implementation a direct call runs (``"cpu"`` only for tests of the other conditions).

    Returns:
        True where the direct call may run; always False on a torch without the private probes these checks read.
        Host time for six tensors on the CPU build machine: about 2.1 us in grad mode, 1.7 us under
        ``inference_mode`` (2.25 / 1.86 us before the thirty-ninth session resolved its probes at import)."""
    if not _DIRECT_PROBES or type(x) not in _PLAIN or _IS_COMPILING():
        return False
    if not (x.is_cuda if device_type == "cuda" else x.device.type == device_type):  # is_cuda: 0.5 us less
        return False
    grad = torch.is_grad_enabled()  # requires_grad is read only where grad mode could record the call
    if grad and x.requires_grad:
        return False
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN or (grad and t.requires_grad)):
            return False
    return not (
        _IS_TRACING()
        or _TORCH_FUNCTION_MODES()
        or _DISPATCH_MODES()
        or _FUNCTORCH_LEVEL() is not None
        or _PROFILER_ON()
    )


@functools.cache
def _direct_class(base: type) -> type:
    """A subclass of ``torch.library.custom_op``'s op class whose call first offers its arguments to the instance's
    ``_eager_direct`` function (same signature as the op): that returns the result, or ``NotImplemented`` where
    :func:`eager_direct` says no, and then the op runs as usual."""

    class EagerDirectOp(base):
        def __call__(self, *args, **kwargs):
            out = self._eager_direct(*args, **kwargs)
            return self._opoverload(*args, **kwargs) if out is NotImplemented else out

    EagerDirectOp.__name__ = EagerDirectOp.__qualname__ = f"EagerDirect{base.__name__}"
    return EagerDirectOp


def attach_eager_direct(op, direct) -> None:
    """Give ``op`` (a ``torch.library.custom_op`` op, as :func:`_define` returns it) an eager direct path: ``direct``
    takes the op's arguments and returns the result of its CUDA implementation, or ``NotImplemented`` (from an
    :func:`eager_direct` check) for the op to run. The op object stays what it was otherwise (``opcheck``, ``register_*``,
    ``torch.ops.prunekit.NAME`` are unchanged). An ``OpOverload`` (the op registered by another copy of this module) is
    left as it is."""
    if isinstance(op, torch._ops.OpOverload):
        return
    op.__class__ = _direct_class(type(op))
    op._eager_direct = direct


def _define(name: str, fn, fake, cuda=None, autograd=None, direct=None):
    """Register ``prunekit::name`` once per process (a package runtime and prunekit may both import this).

    The first copy to import registers the CPU, fake, (when given) CUDA and autograd (``(backward, setup_context)``)
    implementations, and attaches ``direct`` (:func:`attach_eager_direct`); later copies reuse them.
    """
    qualname = f"prunekit::{name}"
    try:
        op = torch.library.custom_op(qualname, mutates_args=(), device_types="cpu")(fn)
    except RuntimeError:
        return getattr(torch.ops.prunekit, name).default
    op.register_fake(fake)
    if cuda is not None:
        op.register_kernel("cuda")(cuda)
    if autograd is not None:
        op.register_autograd(autograd[0], setup_context=autograd[1])
    if direct is not None:
        attach_eager_direct(op, direct)
    return op


def _spmm_csr(
    values: torch.Tensor,
    row_offsets: torch.Tensor,
    column_indices: torch.Tensor,
    row_indices: torch.Tensor,
    x: torch.Tensor,
    m: int,
    bias: torch.Tensor | None = None,
    activation: str = "none",
) -> torch.Tensor:
    y = reference.spmm_csr(values, row_offsets, column_indices, row_indices, x, m, bias, activation)
    return as_spmm_output(y, x)


def _spmm_csr_fake(values, row_offsets, column_indices, row_indices, x, m, bias=None, activation="none"):
    return new_spmm_output(x, m)


def _spmm_csr_cuda(values, row_offsets, column_indices, row_indices, x, m, bias=None, activation="none"):
    return gpu.spmm_csr_op(values, row_offsets, column_indices, row_indices, x, m, bias, activation)


def _spmm_csr_direct(values, row_offsets, column_indices, row_indices, x, m, bias=None, activation="none"):
    if not eager_direct(x, values, row_offsets, column_indices, row_indices, bias):
        return NotImplemented
    return _spmm_csr_cuda(values, row_offsets, column_indices, row_indices, x, m, bias, activation)


def _spmm_csr_setup_context(ctx, inputs, output):
    values, row_offsets, column_indices, row_indices, x, m, bias, activation = inputs
    ctx.activation = activation
    ctx.has_bias = bias is not None
    ctx.save_for_backward(values, row_offsets, column_indices, row_indices, x, output)


def _spmm_csr_backward(ctx, grad_y):
    """Gradients of ``Y = act(A @ X + bias)``: values via SDDMM (``dY X^T`` sampled at A's pattern, Sputnik sec. 6;
    0 at padding entries, so a pruned weight never receives a gradient), X via ``A^T dY``, bias via the row sums."""
    values, row_offsets, column_indices, row_indices, x, y = ctx.saved_tensors
    g = grad_y
    if ctx.activation == "relu":
        g = g * (y > 0).to(g.dtype)
    grad_values = grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_values = sddmm_csr(row_offsets, column_indices, row_indices, g.to(x.dtype), x).to(values.dtype)
    if ctx.needs_input_grad[4]:
        grad_x = spmm_csr_input_grad(values, row_offsets, column_indices, g.to(x.dtype), x.shape[0])
    if ctx.has_bias and ctx.needs_input_grad[6]:
        grad_bias = g.sum(1)
    return grad_values, None, None, None, grad_x, None, grad_bias, None


def spmm_csr_input_grad(
    values: torch.Tensor,
    row_offsets: torch.Tensor,
    column_indices: torch.Tensor,
    dy: torch.Tensor,
    k: int,
    use_kernels: bool | None = None,
) -> torch.Tensor:
    """``dX = A^T dY (K, N)``, the input gradient of ``spmm_csr``.

    With ``use_kernels`` (default: when ``dy`` is on CUDA in ``values``' dtype), this is ``prunekit::spmm_csr`` on the
    transposed pattern (``csr_transpose.cached_transpose_pattern``: built once per pattern), so the backward pass runs
    the same tuned kernels as the forward. Otherwise it is the scatter reference (``reference.spmm_csr_transposed``).

    Args:
        values: ``(nnz_padded,)``; row_offsets: ``(M + 1,)`` int32; column_indices: ``(nnz_padded,)`` int16/int32;
            dy: ``(M, N)`` any strides; k: K.
    """
    if use_kernels is None:
        use_kernels = dy.is_cuda and dy.dtype == values.dtype
    if not use_kernels:
        return reference.spmm_csr_transposed(values, row_offsets, column_indices, dy, k)
    from .csr_transpose import cached_transpose_pattern, transposed_values

    plan = cached_transpose_pattern(row_offsets, column_indices, k, values.dtype)
    return spmm_csr(
        transposed_values(values, plan), plan.row_offsets, plan.column_indices, plan.row_indices, dy.to(values.dtype), k
    )


def _sddmm_csr(
    row_offsets: torch.Tensor,
    column_indices: torch.Tensor,
    row_indices: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
) -> torch.Tensor:
    return reference.sddmm_csr(row_offsets, column_indices, row_indices, a, b)


def _sddmm_csr_fake(row_offsets, column_indices, row_indices, a, b):
    return a.new_empty((column_indices.shape[0],))


def _sddmm_csr_cuda(row_offsets, column_indices, row_indices, a, b):
    return gpu.sddmm_csr(row_offsets, column_indices, row_indices, a, b)


def _sddmm_csr_direct(row_offsets, column_indices, row_indices, a, b):
    if not eager_direct(a, b, row_offsets, column_indices, row_indices):
        return NotImplemented
    return _sddmm_csr_cuda(row_offsets, column_indices, row_indices, a, b)


def _csr_to_dense(
    values: torch.Tensor, row_offsets: torch.Tensor, column_indices: torch.Tensor, m: int, k: int
) -> torch.Tensor:
    return reference.csr_to_dense(values, row_offsets, column_indices, m, k)


def _csr_to_dense_fake(values, row_offsets, column_indices, m, k):
    return values.new_empty((m, k))


def _csr_to_dense_cuda(values, row_offsets, column_indices, m, k):
    return gpu.csr_to_dense(values, row_offsets, column_indices, m, k)


def _csr_to_dense_direct(values, row_offsets, column_indices, m, k):
    if not eager_direct(values, row_offsets, column_indices):
        return NotImplemented
    return _csr_to_dense_cuda(values, row_offsets, column_indices, m, k)


def _bsr_mm(
    blocks: torch.Tensor,
    crow_indices: torch.Tensor,
    col_indices: torch.Tensor,
    x: torch.Tensor,
    m: int,
    bias: torch.Tensor | None = None,
    activation: str = "none",
) -> torch.Tensor:
    return reference.bsr_mm(blocks, crow_indices, col_indices, x, m, bias, activation)


def _bsr_mm_fake(blocks, crow_indices, col_indices, x, m, bias=None, activation="none"):
    return x.new_empty((m, x.shape[1]))


def _nm_mm(
    values: torch.Tensor,
    metadata: torch.Tensor,
    x: torch.Tensor,
    n: int,
    m_group: int,
    bits: int,
    bias: torch.Tensor | None = None,
    activation: str = "none",
) -> torch.Tensor:
    return reference.nm_mm(values, metadata, x, n, m_group, bits, bias, activation)


def _nm_mm_fake(values, metadata, x, n, m_group, bits, bias=None, activation="none"):
    return x.new_empty((values.shape[0], x.shape[1]))


sddmm_csr = _define("sddmm_csr", _sddmm_csr, _sddmm_csr_fake, _sddmm_csr_cuda, direct=_sddmm_csr_direct)
"""``prunekit::sddmm_csr(row_offsets, column_indices, row_indices, a, b) -> (nnz_padded,)``: ``(A @ B^T)`` sampled at
a CSR pattern (Sputnik SDDMM), ``a: (M, K_inner)``, ``b: (N, K_inner)``; padding entries are 0."""
spmm_csr = _define(
    "spmm_csr",
    _spmm_csr,
    _spmm_csr_fake,
    _spmm_csr_cuda,
    autograd=(_spmm_csr_backward, _spmm_csr_setup_context),
    direct=_spmm_csr_direct,
)
"""``prunekit::spmm_csr(values, row_offsets, column_indices, row_indices, x, m, bias=None, activation="none")``:
``Y (M, N) = act(A @ X + bias[:, None])`` with A in prunekit CSR (Sputnik SpMM, Gale et al. 2020). A column-major
``x`` (``x2d.t()``) gives a column-major Y (``layout.py``). CPU: reference; CUDA: ``gpu.spmm_csr_op`` (its C++ entries, else
``gpu.spmm_csr``). Differentiable in
``values`` (SDDMM), ``x`` and ``bias``."""
csr_to_dense = _define(
    "csr_to_dense", _csr_to_dense, _csr_to_dense_fake, _csr_to_dense_cuda, direct=_csr_to_dense_direct
)
"""``prunekit::csr_to_dense(values, row_offsets, column_indices, m, k) -> (M, K)``: a prunekit CSR weight as a dense
matrix in the values' dtype (columns unique within a row apart from zero padding, as the format stores them). CPU:
reference; CUDA: ``gpu.csr_to_dense``, the ``dense`` SpMM variant's decompression kernel. Not differentiable."""
bsr_mm = _define("bsr_mm", _bsr_mm, _bsr_mm_fake)
nm_mm = _define("nm_mm", _nm_mm, _nm_mm_fake)
from . import structured  # noqa: E402,F401  (CUDA impls of bsr_mm / nm_mm)

# The CUDA implementations' launchers (imported with structured above already; bound here so that the CUDA and direct
# functions above need no import statement per call: 0.4 us on the build machine)
from . import gpu  # noqa: E402  # isort: skip

from . import ks  # noqa: E402,F401  # isort: skip  (prunekit::ks_mm)

from . import split24  # noqa: E402,F401  # isort: skip  (prunekit::residual_rows)
