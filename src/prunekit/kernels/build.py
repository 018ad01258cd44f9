"""Build and load prunekit's CUDA extension: JIT with ``torch.utils.cpp_extension`` (ninja), cached by content.

The extension is one shared library built from ``csrc/`` that registers the ``prunekit_ext::*`` operators (it has no
Python bindings, so it is loaded with ``torch.ops.load_library`` and a prebuilt copy works under any Python of the same
torch build). It is compiled on first use into ``$PRUNEKIT_KERNEL_CACHE`` (default ``~/.cache/prunekit/kernels``) in a
directory named by :func:`build_key`: sha256 of the sources, the torch version, the CUDA version and the target archs,
so a changed source or toolchain never loads a stale library. Targets: explicit ``-gencode`` for sm_80 and sm_90 (plus
the visible GPU's arch when it is neither) and compute_90 PTX for newer GPUs; ``PRUNEKIT_CUDA_ARCHS="90"`` narrows it.

A library whose file name carries the same key is used instead of compiling when found in ``$PRUNEKIT_KERNEL_PREBUILT``
or the ``prebuilt/`` folder beside this module (where an exported package's ``runtime/`` keeps it).

Importing this module never fails; :func:`load` raises :class:`KernelUnavailable` with one sentence when there is no
CUDA torch, no GPU, no compiler, or the build fails. torch and stdlib only (copied into exported packages).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
from pathlib import Path

import torch

from ..errors import KernelUnavailable

log = logging.getLogger(__name__)

CSRC_DIR = Path(__file__).resolve().parent / "csrc"
PREBUILT_DIR = Path(__file__).resolve().parent / "prebuilt"
SOURCES = ("bindings.cpp", "spmm_rowwarp.cu", "spmm_direct.cu", "spmm_tiled.cu", "sddmm_csr.cu")
HEADERS = ("common.cuh", "kernels.h")
DEFAULT_ARCHS = ("80", "90")
MIN_CAPABILITY = (8, 0)  # bf16 conversion intrinsics need sm_80
NAMESPACE = "prunekit_ext"
CACHE_ENV = "PRUNEKIT_KERNEL_CACHE"
ARCHS_ENV = "PRUNEKIT_CUDA_ARCHS"
PREBUILT_ENV = "PRUNEKIT_KERNEL_PREBUILT"

_lock = threading.Lock()
_loaded_path: Path | None = None

__all__ = [
    "build_key",
    "cache_root",
    "copy_prebuilt",
    "gencode_flags",
    "is_loaded",
    "library_name",
    "load",
    "loaded_library",
    "source_digest",
    "target_archs",
    "unavailable_reason",
]


def cache_root() -> Path:
    """Directory holding one build folder per key: ``$PRUNEKIT_KERNEL_CACHE`` or ``~/.cache/prunekit/kernels``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "prunekit" / "kernels"


def target_archs(device_capability: tuple[int, int] | None = None) -> tuple[str, ...]:
    """Compute capabilities to compile SASS for, e.g. ``("80", "90")``.

    ``$PRUNEKIT_CUDA_ARCHS`` (``"90"``, ``"80;90"``) overrides; otherwise :data:`DEFAULT_ARCHS` plus the given device's
    capability when it is at least sm_80 and not already listed.
    """
    env = os.environ.get(ARCHS_ENV)
    if env:
        archs = {a.strip().replace(".", "") for a in env.replace(",", ";").split(";") if a.strip()}
    else:
        archs = set(DEFAULT_ARCHS)
        if device_capability is not None and tuple(device_capability) >= MIN_CAPABILITY:
            archs.add(f"{device_capability[0]}{device_capability[1]}")
    return tuple(sorted(archs, key=int))


def gencode_flags(archs: tuple[str, ...]) -> list[str]:
    """nvcc ``-gencode`` flags: SASS for every arch and PTX for the highest (runs, JIT-compiled, on newer GPUs)."""
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    top = archs[-1]
    flags.append(f"-gencode=arch=compute_{top},code=compute_{top}")
    return flags


def source_digest(csrc_dir: Path = CSRC_DIR) -> str:
    """sha256 (hex) over the names and bytes of every source and header in ``csrc_dir``."""
    digest = hashlib.sha256()
    for name in sorted(SOURCES + HEADERS):
        digest.update(name.encode())
        digest.update(b"\0")
        digest.update((csrc_dir / name).read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def build_key(source_sha256: str, torch_version: str, cuda_version: str | None, archs: tuple[str, ...]) -> str:
    """sha256 (hex) naming one build: sources, torch version, CUDA version and target archs."""
    payload = json.dumps(
        {"sources": source_sha256, "torch": torch_version, "cuda": cuda_version, "archs": list(archs)}, sort_keys=True
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def library_name(key: str) -> str:
    """Extension (and .so file stem) name for a build key."""
    return f"prunekit_kernels_{key[:16]}"


def _device_capability() -> tuple[int, int] | None:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def current_key() -> str:
    """:func:`build_key` for this process's torch, CUDA and visible GPU."""
    return build_key(source_digest(), torch.__version__, torch.version.cuda, target_archs(_device_capability()))


def unavailable_reason(need_compiler: bool = True) -> str | None:
    """Why the CUDA kernels cannot run here (one sentence), or None when they can."""
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support; install a CUDA build of torch"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch (torch.cuda.is_available() is False)"
    cap = torch.cuda.get_device_capability()
    if tuple(cap) < MIN_CAPABILITY:
        return f"the GPU has compute capability {cap[0]}.{cap[1]}; prunekit's kernels need 8.0 or newer"
    if need_compiler:
        from torch.utils import cpp_extension

        if cpp_extension.CUDA_HOME is None:
            return "no CUDA compiler found (nvcc); install the CUDA toolkit or set CUDA_HOME"
        if not cpp_extension.is_ninja_available():
            return "ninja is not installed; pip install ninja"
    return None


def is_loaded() -> bool:
    """True when the ``prunekit_ext`` operators are registered in this process."""
    try:
        getattr(torch.ops, NAMESPACE).spmm_csr_tiled  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def loaded_library() -> Path | None:
    """Path of the .so loaded by :func:`load` in this process (for the exporter to copy), or None."""
    return _loaded_path


def copy_prebuilt(dest_dir: Path) -> Path | None:
    """Copy the library loaded in this process into ``dest_dir`` under its key name (for an exported package).

    A later :func:`load` in a process with the same sources, torch, CUDA and archs finds it when ``dest_dir`` is
    ``$PRUNEKIT_KERNEL_PREBUILT`` or the ``prebuilt/`` folder beside this module. Returns the copy's path, or None when
    no library was loaded by this module.
    """
    if _loaded_path is None or not Path(_loaded_path).is_file():
        return None
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    target = dest_dir / Path(_loaded_path).name
    if Path(_loaded_path).resolve() != target.resolve():
        shutil.copy2(_loaded_path, target)
    return target


def _prebuilt(key: str) -> Path | None:
    dirs = [Path(os.environ[PREBUILT_ENV])] if os.environ.get(PREBUILT_ENV) else []
    dirs.append(PREBUILT_DIR)
    for folder in dirs:
        candidate = folder / f"{library_name(key)}.so"
        if candidate.is_file():
            return candidate
    return None


def load(verbose: bool = False) -> Path | None:
    """Make the ``prunekit_ext`` operators available, building the extension if needed (minutes, once per key).

    Returns:
        Path of the loaded library, or None when another copy registered the operators first.

    Raises:
        KernelUnavailable: no CUDA torch, no GPU of sm_80 or newer, no nvcc/ninja, or the compilation failed.
    """
    global _loaded_path
    with _lock:
        if is_loaded():
            return _loaded_path
        key = current_key()
        prebuilt = _prebuilt(key)
        reason = unavailable_reason(need_compiler=prebuilt is None)
        if reason is not None:
            raise KernelUnavailable(f"prunekit's CUDA kernels are unavailable: {reason}.")
        if prebuilt is not None:
            log.info("loading prebuilt kernels %s", prebuilt)
            torch.ops.load_library(str(prebuilt))
            _loaded_path = prebuilt
            return prebuilt
        _loaded_path = _compile(key, verbose)
        return _loaded_path


def _compile(key: str, verbose: bool) -> Path:
    from torch.utils import cpp_extension

    name = library_name(key)
    build_dir = cache_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    archs = target_archs(_device_capability())
    log.info("building prunekit CUDA kernels for sm_%s into %s", ",".join(archs), build_dir)
    try:
        cpp_extension.load(
            name=name,
            sources=[str(CSRC_DIR / s) for s in SOURCES],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", "-lineinfo", *gencode_flags(archs)],
            build_directory=str(build_dir),
            verbose=verbose,
            is_python_module=False,
        )
    except Exception as exc:  # compiler errors arrive as RuntimeError/CalledProcessError with the full log
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise KernelUnavailable(
            f"building prunekit's CUDA kernels failed ({first}); rerun `prunekit kernels build --verbose` "
            f"to see the compiler output (build folder {build_dir})."
        ) from exc
    return build_dir / f"{name}.so"
