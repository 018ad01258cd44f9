"""CPU: the custom ops' eager direct path (``ops.eager_direct``, ``ops.attach_eager_direct``). The direct call runs
an op's CUDA implementation without the custom-op layers only where those layers would add nothing; the conditions are
checked here with ``device_type="cpu"`` (the GPU tests of the ops run the direct calls themselves), and the routing of
each op's call with the CUDA implementation replaced by a recorder."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from prunekit.kernels import ops, structured


def direct(*tensors) -> bool:
    return ops.eager_direct(*tensors, device_type="cpu")


class _Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_plain_tensors_without_gradients_take_the_direct_call():
    x, w = torch.randn(4, 3), torch.randn(5)
    assert direct(x, w, None)
    assert direct(x, torch.nn.Parameter(w, requires_grad=False))
    assert not ops.eager_direct(x, w)  # on the CPU, the CUDA implementation is never called directly


def test_a_gradient_to_record_keeps_the_op():
    x, w = torch.randn(4, 3), torch.randn(5, requires_grad=True)
    assert not direct(x, w)
    assert not direct(x.requires_grad_(), None)
    with torch.no_grad():
        assert direct(x, w)
    with torch.inference_mode():
        assert direct(torch.randn(4, 3), torch.randn(5))


def test_subclasses_modes_transforms_tracing_and_the_profiler_keep_the_op():
    x = torch.randn(4, 3)

    class Sub(torch.Tensor):
        pass

    assert not direct(x.as_subclass(Sub))
    assert not direct(x, torch.randn(2).as_subclass(Sub))
    with _Passthrough():
        assert not direct(x)
    with torch.device("cpu"):  # a torch-function mode
        assert not direct(x)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert not direct(x)
    seen = []

    def f(t):
        seen.append(direct(t))
        return t * 2

    torch.func.vmap(f)(x)
    torch.jit.trace(f, x, check_trace=False)  # one traced run (the check would rerun f eagerly)
    assert seen == [False, False]
    assert direct(x)  # and nothing is left switched on


def test_a_torch_without_the_probes_never_takes_the_direct_call(monkeypatch):
    monkeypatch.setattr(ops, "_DIRECT_PROBES", False)
    assert not direct(torch.randn(4, 3))


def _csr():
    values = torch.tensor([1.0, 2.0, 3.0, 0.0])
    row_offsets = torch.tensor([0, 2, 2, 4], dtype=torch.int32)
    column_indices = torch.tensor([0, 2, 1, 0], dtype=torch.int16)
    row_indices = torch.tensor([0, 2, 1], dtype=torch.int32)
    return values, row_offsets, column_indices, row_indices


def test_spmm_csr_routes_its_call_by_eager_direct(monkeypatch):
    values, offsets, cols, rows = _csr()
    x = torch.randn(3, 2)
    ref = ops.spmm_csr(values, offsets, cols, rows, x, 3)  # the op (reference on the CPU)
    calls = []
    marker = torch.full((3, 2), 7.0)

    def cuda(*args):
        calls.append(args)
        return marker

    monkeypatch.setattr(ops, "_spmm_csr_cuda", cuda)
    monkeypatch.setattr(ops, "eager_direct", lambda *t, **k: True)
    bias = torch.ones(3)
    out = ops.spmm_csr(values, offsets, cols, rows, x=x, m=3, bias=bias, activation="relu")
    assert out is marker
    assert len(calls) == 1 and calls[0][4] is x and calls[0][5:] == (3, bias, "relu")
    monkeypatch.setattr(ops, "eager_direct", lambda *t, **k: False)
    torch.testing.assert_close(ops.spmm_csr(values, offsets, cols, rows, x, 3), ref)
    assert len(calls) == 1  # the op ran, not the recorder


ARITY = {"bsr_mm": 5, "bsr_mm_static": 7, "nm_mm": 6, "sddmm_csr": 5, "csr_to_dense": 5}  # required arguments


@pytest.mark.parametrize("name", sorted(ARITY))
def test_every_op_with_a_cuda_implementation_has_the_direct_path(name, monkeypatch):
    op = getattr(structured, name) if name == "bsr_mm_static" else getattr(ops, name)
    assert type(op).__name__.startswith("EagerDirect")
    assert isinstance(op, torch._library.custom_ops.CustomOpDef)  # still the op: opcheck, register_*, .name
    asked = []
    monkeypatch.setattr(ops, "eager_direct", lambda *t, **k: asked.append(t) or False)
    args = [torch.zeros(2) for _ in range(ARITY[name])]
    assert op._eager_direct(*args) is NotImplemented  # the op runs the call
    assert len(asked) == 1 and all(isinstance(t, torch.Tensor) or t is None for t in asked[0])
