"""Fast Python entries to the runtime's eager C++ operators: the same operators, called with less host time.

``torch.ops.NS.OP.default(...)`` parses its arguments against the operator's schema in Python-facing C++ before the
dispatcher runs. On the build machine that costs about 1.3 us per call for five arguments and 2 us for ten, against
calling the same operator through its typed dispatcher handle from a pybind11 function
(``csrc/fastcall/fastcall.cpp``). At decode sizes a whole eager call of ``SparseLinear`` costs 10-14 us of host time,
so the runtime's eager paths (``SparseLinear``'s BSR, 2:4, bitmap and CSR calls) take their C++ entry from here.

What stays the same: the operator and its kernel, the dispatcher (autograd fallback, profiler records, dispatch modes),
arguments, results and errors. What is skipped: the schema parsing in Python, and ``__torch_function__`` overrides of
tensor subclasses (the eager paths run only on plain CUDA tensors).

The module is a Python extension, so unlike the kernel libraries it is built per Python version (its key holds the
interpreter's cache tag). It has no CUDA code: the host C++ compiler and ninja build it in about a minute, into
``$PRUNEKIT_KERNEL_CACHE`` (or it is found prebuilt beside the kernel libraries). Where it cannot be built or is turned
off (``$PRUNEKIT_FASTCALL=0``, read once per process when the module is first needed, or :func:`disabled` for a
block), :func:`entry` gives the ``OpOverload``, so
nothing fails; the first failure is logged once.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
import sysconfig
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch

from . import build

log = logging.getLogger(__name__)

ENV = "PRUNEKIT_FASTCALL"
SOURCE = build.CSRC_DIR / "fastcall" / "fastcall.cpp"
PREFIX = "prunekit_fastcall"
ENTRIES = {
    "bsr_mm": ("prunekit_structured", "bsr_mm"),
    "linear": ("prunekit_nm24", "linear"),
    "bitmap_linear": ("prunekit_nm24", "bitmap_linear"),
    "spmv24": ("prunekit_nm24", "spmv24"),
    "spmm_csr_auto": ("prunekit_ext", "spmm_csr_auto"),
}
"""Function name in the module -> the operator (namespace, name) it calls, with the same arguments."""

_lock = threading.Lock()
_state: dict[str, object] = {}  # "module": the loaded module, or None (turned off, or failed); "path": its file
_overloads: dict[str, Callable[..., torch.Tensor]] = {}  # name -> the operator's OpOverload, once resolved
_fast: dict[str, Callable[..., torch.Tensor]] = {}  # name -> the module's function, once its operator was found
_UNSET = object()
_off = threading.local()


def key() -> str:
    """sha256 (hex) naming one build: the source, torch's version and CUDA version, and this interpreter's extension
    suffix (its version and ABI, e.g. ``.cpython-311-x86_64-linux-gnu.so``)."""
    source = hashlib.sha256(SOURCE.read_bytes()).hexdigest()
    python = sysconfig.get_config_var("EXT_SUFFIX") or sys.implementation.cache_tag
    return build.build_key(source, torch.__version__, torch.version.cuda, (), f"fastcall {python}")


def library_name() -> str:
    """``prunekit_fastcall_{key16}``: the module name and .so file stem of this process's build."""
    return f"{PREFIX}_{key()[:16]}"


def _import(name: str, path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _build(name: str, source: Path = SOURCE) -> tuple[ModuleType, Path]:
    """Build (or load from the kernel cache) the module ``name`` from ``source`` (this tree's ``fastcall.cpp``;
    ``benchmarks/entry_host_probe.py`` builds another commit's beside it): the module and its file."""
    from torch.utils import cpp_extension

    build_dir = build.cache_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    log.info("building prunekit's fast-call module into %s", build_dir)
    module = cpp_extension.load(
        name=name,
        sources=[str(source)],
        extra_cflags=["-O3"],
        build_directory=str(build_dir),
        with_cuda=False,
        is_python_module=True,
        verbose=False,
    )
    return module, build_dir / f"{name}.so"


def load() -> ModuleType | None:
    """The fast-call module, loaded (prebuilt, cached or built) on the first call; None where ``$PRUNEKIT_FASTCALL`` is
    ``0`` (read here, once per process) or it cannot be built (logged once as a warning; :func:`entry` then gives the
    operators themselves). The answer is kept for the process. Never raises."""
    if "module" in _state:
        return _state["module"]
    with _lock:
        if "module" not in _state and os.environ.get(ENV, "") == "0":
            _state["path"] = _state["module"] = None
        if "module" not in _state:
            module = path = None
            try:
                name = library_name()
                prebuilt = next(
                    (d / f"{name}.so" for d in build._prebuilt_dirs() if (d / f"{name}.so").is_file()), None
                )
                module, path = (_import(name, prebuilt), prebuilt) if prebuilt else _build(name)
            except Exception as exc:  # no compiler or ninja, a failed build: the operators are called as they are
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                log.warning("prunekit's fast-call module is unavailable (%s); eager calls use torch.ops", first)
            _state["path"] = path
            _state["module"] = module
    return _state["module"]


def loaded_path() -> Path | None:
    """The file of the module loaded in this process (for the exporter to ship), or None."""
    return _state.get("path")


def entry(name: str) -> Callable[..., torch.Tensor]:
    """The fast entry ``name`` (a key of :data:`ENTRIES`), or the operator's ``OpOverload`` where the module is off
    (``$PRUNEKIT_FASTCALL=0``, inside :func:`disabled`) or unavailable. Both take the same arguments and give the same
    result. The module's function is given only once its operator is found with the signature it was built for
    (``ready`` in ``fastcall.cpp``); before that, or on a mismatch, the ``OpOverload`` is. The operator's library must
    be loaded for either to run. After the first call this is a dictionary lookup or two (0.6 us on the build machine
    at most, against the 1.3-2 us a fast entry saves), so the kernels' per-call wrappers (``gpu.spmm_csr_op``,
    ``nm24.linear``, ...) call it on every call.

    Raises:
        KeyError: ``name`` is not one of :data:`ENTRIES`."""
    if not getattr(_off, "on", False):
        fast = _fast.get(name)
        if fast is not None:
            return fast
        module = _state.get("module", _UNSET)
        if module is _UNSET:
            module = load()
        # handed out once its operator is found with the expected signature (a library not loaded yet: asked again
        # next time); else the OpOverload runs the call, so a mismatch cannot make every call raise
        if module is not None and name in ENTRIES and module.ready(name):
            fast = _fast[name] = getattr(module, name)
            return fast
    overload = _overloads.get(name)
    if overload is None:  # resolved once per name (about 1.5 us through torch.ops' namespaces)
        namespace, op = ENTRIES[name]
        overload = _overloads[name] = getattr(getattr(torch.ops, namespace), op).default
    return overload


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within this block (this thread), :func:`entry` gives the operators' ``OpOverload``: for benchmarks that time
    the two ways of calling side by side (``benchmarks/layer_host.py --base-no-fastcall``)."""
    before = getattr(_off, "on", False)
    _off.on = True
    try:
        yield
    finally:
        _off.on = before
