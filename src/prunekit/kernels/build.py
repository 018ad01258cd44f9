"""Build and load prunekit's CUDA extensions: JIT with ``torch.utils.cpp_extension`` (ninja), cached by content.

Each library is declared once as an :class:`Extension` (sources, headers, flags, operator namespace) next to its
Python wrappers: :data:`MAIN` here (SpMM/SDDMM, ``prunekit_ext``), ``structured.EXTENSION`` (BSR/2:4),
``ks.EXTENSION`` (Kronecker-sparse), ``spdnn_cuda.EXTENSION`` (fused SpDNN layer chain); :func:`extensions` lists them
and ``scripts/compile_check.py`` compiles their sources without a GPU. A library registers its operators with
``TORCH_LIBRARY`` and has no Python bindings, so it is loaded with ``torch.ops.load_library`` and a prebuilt copy works
under any Python of the same torch build. :func:`load_extension` compiles it on first use into
``$PRUNEKIT_KERNEL_CACHE`` (default ``~/.cache/prunekit/kernels``) in a directory named by :func:`build_key`: sha256 of
the sources, the torch version, the CUDA version, the target archs and the flags, so a changed source or toolchain
never loads a stale library. Targets: explicit ``-gencode`` for sm_80 and sm_90 (plus the visible GPU's arch when it
is neither) and compute_90 PTX for newer GPUs; ``PRUNEKIT_CUDA_ARCHS="90"`` narrows it.

A library whose file name carries the same key is used instead of compiling when found in ``$PRUNEKIT_KERNEL_PREBUILT``
or the ``prebuilt/`` folder beside this module (where an exported package's ``runtime/`` keeps it).

Importing this module never fails; loading raises :class:`KernelUnavailable` with one sentence when there is no
CUDA torch, no GPU, no compiler, or the build fails. torch and stdlib only (copied into exported packages).
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import threading
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..errors import KernelUnavailable

log = logging.getLogger(__name__)

CSRC_DIR = Path(__file__).resolve().parent / "csrc"
PREBUILT_DIR = Path(__file__).resolve().parent / "prebuilt"
SOURCES = (
    "bindings.cpp",
    "spmm_entry.cu",
    "spmm_rowwarp.cu",
    "spmv_csr.cu",
    "spmm_direct.cu",
    "spmm_tiled.cu",
    "spmm_tc.cu",
    "spmm_scatter.cu",
    "spmm_dense.cu",
    "spmm_residual.cu",
    "sddmm_csr.cu",
)
HEADERS = ("check.h", "common.cuh", "kernels.h", "launch.cuh", "mma.cuh", "views.h")
DEFAULT_ARCHS = ("80", "90")
MIN_CAPABILITY = (8, 0)  # bf16 conversion intrinsics need sm_80
NAMESPACE = "prunekit_ext"
CACHE_ENV = "PRUNEKIT_KERNEL_CACHE"
ARCHS_ENV = "PRUNEKIT_CUDA_ARCHS"
PREBUILT_ENV = "PRUNEKIT_KERNEL_PREBUILT"

_lock = threading.Lock()

__all__ = [
    "Extension",
    "MAIN",
    "build_key",
    "build_many",
    "cache_root",
    "copy_prebuilt",
    "extension_loaded",
    "extensions",
    "find_prebuilt",
    "gencode_flags",
    "is_loaded",
    "jobs_per_build",
    "library_name",
    "load",
    "load_all",
    "load_extension",
    "loaded_libraries",
    "loaded_library",
    "source_digest",
    "target_archs",
    "unavailable_reason",
]


def setting(value: str | None, env: str, default: str, allowed, what: str) -> str:
    """A kernel option: ``value``, else ``$env``, else ``default``, checked against ``allowed``.

    Raises:
        ValueError: a name not in ``allowed`` (one sentence naming ``what`` and the known names).
    """
    name = value or os.environ.get(env) or default
    if name not in allowed:
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(allowed)}")
    return name


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


ARCH_SPECIFIC = {"90": "90a"}  # archs whose arch-specific target (wgmma, setmaxnreg) an Extension may ask for


def gencode_flags(archs: tuple[str, ...], arch_specific: bool = False) -> list[str]:
    """nvcc ``-gencode`` flags: SASS for every arch and PTX for the highest (runs, JIT-compiled, on newer GPUs).

    ``arch_specific`` compiles sm_90 as ``sm_90a`` (Hopper's wgmma/TMA instructions; that SASS runs on sm_90 GPUs
    only), while the PTX for newer GPUs stays the portable ``compute_XX``.
    """
    flags = []
    for a in archs:
        t = ARCH_SPECIFIC.get(a, a) if arch_specific else a
        flags.append(f"-gencode=arch=compute_{t},code=sm_{t}")
    top = archs[-1]
    flags.append(f"-gencode=arch=compute_{top},code=compute_{top}")
    return flags


def source_digest(csrc_dir: Path = CSRC_DIR) -> str:
    """sha256 (hex) over the names and bytes of the main library's sources and headers found in ``csrc_dir``."""
    return replace(MAIN, csrc_dir=Path(csrc_dir)).source_digest()


def build_key(
    source_sha256: str, torch_version: str, cuda_version: str | None, archs: tuple[str, ...], extra: str = ""
) -> str:
    """sha256 (hex) naming one build: sources, torch version, CUDA version, target archs (and flags etc. in ``extra``)."""
    fields = {"sources": source_sha256, "torch": torch_version, "cuda": cuda_version, "archs": list(archs)}
    if extra:
        fields["extra"] = extra
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _device_capability() -> tuple[int, int] | None:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


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


@dataclass(frozen=True)
class Extension:
    """One CUDA/C++ extension library of prunekit: what to compile, how, and how to tell it is loaded.

    Every library registers operators with ``TORCH_LIBRARY`` under ``namespace`` and has no Python bindings, so it is
    loaded with ``torch.ops.load_library``. Its build folder and .so file are named ``{prefix}_{key16}``, the key being
    the sha256 of (its sources' names and bytes, torch version, CUDA version, target archs, flags, ``key_extra``).

    Attributes:
        namespace: operator namespace the library registers (``prunekit_ext``, ``prunekit_structured``, ...).
        prefix: library name prefix.
        csrc_dir: folder of ``sources`` and ``headers``.
        sources: files compiled (``.cu`` with nvcc, ``.cpp`` with the host compiler).
        headers: files included by the sources (hashed into the key, not compiled).
        probe: an operator name in ``namespace`` whose presence means the library is loaded.
        description: what the kernels are, for error messages ("structured-sparse CUDA kernels").
        cuda_cflags: extra nvcc flags (the ``-gencode`` flags are added by :func:`gencode_flags`).
        include_paths / ldflags: extra include folders and linker flags.
        gencode: compile ``.cu`` sources for :func:`target_archs` (False for a C++-only library).
        arch_specific: compile sm_90 as sm_90a (see :func:`gencode_flags`).
        prebuilt: whether the exporter may ship this library in a package (False when it links a library by rpath).
        key_extra: anything else the build depends on (e.g. the folder of a linked library).
    """

    namespace: str
    prefix: str
    csrc_dir: Path
    sources: tuple[str, ...]
    headers: tuple[str, ...] = ()
    probe: str = ""
    description: str = "CUDA kernels"
    cuda_cflags: tuple[str, ...] = ("-O3", "-lineinfo")
    include_paths: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    gencode: bool = True
    arch_specific: bool = False
    prebuilt: bool = True
    key_extra: str = ""

    def source_digest(self) -> str:
        """sha256 (hex) over the names and bytes of the sources and headers."""
        digest = hashlib.sha256()
        for name in sorted(self.sources + self.headers):
            digest.update(name.encode() + b"\0" + (self.csrc_dir / name).read_bytes() + b"\0")
        return digest.hexdigest()

    def key(self, archs: tuple[str, ...] | None = None) -> str:
        """sha256 (hex) naming one build of this library for ``archs`` (default: this machine's targets)."""
        archs = target_archs(_device_capability()) if archs is None else archs
        extra = json.dumps([*self.cuda_cflags, *self.include_paths, *self.ldflags, self.key_extra, self.arch_specific])
        return build_key(
            self.source_digest(), torch.__version__, torch.version.cuda, archs if self.gencode else (), extra
        )

    def library_name(self, archs: tuple[str, ...] | None = None) -> str:
        """``{prefix}_{key16}``: the extension (and .so file stem) name."""
        return f"{self.prefix}_{self.key(archs)[:16]}"

    def nvcc_flags(self, archs: tuple[str, ...]) -> list[str]:
        """nvcc flags of a build for ``archs``: :attr:`cuda_cflags` plus the ``-gencode`` flags."""
        return [*self.cuda_cflags, *(gencode_flags(archs, self.arch_specific) if self.gencode else [])]


_registry: dict[str, Path] = {}  # namespace -> library loaded by load_extension in this process
_ready: set[str] = set()  # namespaces known to be loaded (the per-call fast check)


def extension_loaded(ext: Extension) -> bool:
    """True when ``ext``'s operators are registered in this process (by this module or another copy)."""
    if ext.namespace in _ready:
        return True
    try:
        getattr(getattr(torch.ops, ext.namespace), ext.probe)  # noqa: B009
    except (AttributeError, RuntimeError):
        return False
    _ready.add(ext.namespace)
    return True


def _prebuilt_dirs() -> list[Path]:
    dirs = [Path(os.environ[PREBUILT_ENV])] if os.environ.get(PREBUILT_ENV) else []
    dirs.append(PREBUILT_DIR)
    return dirs


def find_prebuilt(ext: Extension, archs: tuple[str, ...] | None = None) -> Path | None:
    """A prebuilt ``{library_name}.so`` for this key in ``$PRUNEKIT_KERNEL_PREBUILT`` or ``prebuilt/``, or None."""
    if not ext.prebuilt:
        return None
    name = ext.library_name(archs)
    for folder in _prebuilt_dirs():
        candidate = folder / f"{name}.so"
        if candidate.is_file():
            return candidate
    return None


def load_extension(ext: Extension, verbose: bool = False) -> Path | None:
    """Make ``ext``'s operators available: a loaded copy, a prebuilt library, or a JIT build (minutes, once per key).

    Returns:
        Path of the loaded library, or None when another copy registered the operators first.

    Raises:
        KernelUnavailable: no CUDA torch, no GPU of sm_80 or newer, no nvcc/ninja, or the compilation failed.
    """
    with _lock:
        if extension_loaded(ext):
            return _registry.get(ext.namespace)
        prebuilt = find_prebuilt(ext)
        reason = unavailable_reason(need_compiler=prebuilt is None)
        if reason is not None:
            raise KernelUnavailable(f"prunekit's {ext.description} are unavailable: {reason}.")
        if prebuilt is not None:
            log.info("loading prebuilt %s %s", ext.description, prebuilt)
            torch.ops.load_library(str(prebuilt))
            path = prebuilt
        else:
            path = _compile(ext, verbose)
        _registry[ext.namespace] = path
        _ready.add(ext.namespace)
        return path


def _built(ext: Extension) -> bool:
    """True when ``ext``'s library for this machine's targets is already in the kernel cache (a finished build: ninja
    links the .so last)."""
    name = ext.library_name(target_archs(_device_capability()))
    return (cache_root() / name / f"{name}.so").is_file()


def jobs_per_build(builds: int, cpus: int | None = None, env: str | None = None) -> int:
    """Compiler jobs (ninja's ``MAX_JOBS``) for each of ``builds`` libraries built at once: ``env`` (the user's
    ``$MAX_JOBS``) when set, else twice the CPUs shared evenly (the small libraries finish first and leave their CPUs
    to the long one; a library's jobs are fixed when its build starts), at least 1 and at most the CPU count.

    Args:
        builds: libraries compiled side by side (>= 1); cpus: CPU count (default ``os.cpu_count()``); env: the
            ``$MAX_JOBS`` value (default: read from the environment).

    Raises:
        ValueError: ``$MAX_JOBS`` is not a positive integer.
    """
    env = os.environ.get("MAX_JOBS") if env is None else env
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"MAX_JOBS must be a positive integer, got {env!r}")
        return int(env)
    cpus = cpus or os.cpu_count() or 1
    return min(cpus, max(1, -(-2 * cpus // max(1, builds))))


def _compile_in_child(ext: Extension, jobs: int, verbose: bool) -> str:
    os.environ["MAX_JOBS"] = str(jobs)
    return str(_compile(ext, verbose))


def build_many(exts: list[Extension], verbose: bool = False, parallel: bool = True) -> dict[str, Path | None]:
    """Build the libraries ``exts`` that are neither loaded, prebuilt nor cached, side by side (one process each, the
    CPUs shared by :func:`jobs_per_build`), then load every one of them in this process (cache hits).

    A cold build of every library takes about as long as the slowest one alone (the structured library: a few minutes)
    instead of their sum. ``parallel=False`` compiles them one after the other in this process.

    Returns:
        namespace -> path of the loaded library (None when another copy registered its operators first).

    Raises:
        KernelUnavailable: no CUDA torch, no GPU of sm_80 or newer, no nvcc/ninja, or a build failed (the first
            failure's sentence; every build runs to its end first).
        ValueError: a bad ``$MAX_JOBS``.
    """
    reason = unavailable_reason(need_compiler=False)
    if reason is not None:
        raise KernelUnavailable(f"prunekit's CUDA kernels are unavailable: {reason}.")
    todo = [e for e in exts if not extension_loaded(e) and find_prebuilt(e) is None and not _built(e)]
    if parallel and len(todo) > 1:
        reason = unavailable_reason(need_compiler=True)
        if reason is not None:
            raise KernelUnavailable(f"prunekit's CUDA kernels are unavailable: {reason}.")
        jobs = jobs_per_build(len(todo))
        errors = []
        with ProcessPoolExecutor(max_workers=len(todo), mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(_compile_in_child, e, jobs, verbose) for e in todo]
            for ext, future in zip(todo, futures):
                try:
                    future.result()
                except KernelUnavailable as exc:
                    errors.append(str(exc))
                except Exception as exc:  # the build process died (e.g. out of memory: BrokenProcessPool)
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                    errors.append(
                        f"building prunekit's {ext.description} failed ({first}); retry with fewer jobs, "
                        "e.g. MAX_JOBS=2 prunekit kernels build"
                    )
        if errors:
            raise KernelUnavailable(errors[0])
    return {e.namespace: load_extension(e, verbose) for e in exts}


def _compile(ext: Extension, verbose: bool) -> Path:
    from torch.utils import cpp_extension

    archs = target_archs(_device_capability())
    name = ext.library_name(archs)
    build_dir = cache_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    log.info("building prunekit %s for sm_%s into %s", ext.description, ",".join(archs), build_dir)
    try:
        cpp_extension.load(
            name=name,
            sources=[str(ext.csrc_dir / s) for s in ext.sources],
            extra_cflags=["-O3"],
            extra_cuda_cflags=ext.nvcc_flags(archs),
            extra_include_paths=list(ext.include_paths),
            extra_ldflags=list(ext.ldflags),
            build_directory=str(build_dir),
            with_cuda=True,
            verbose=verbose,
            is_python_module=False,
        )
    except Exception as exc:  # compiler errors arrive as RuntimeError/CalledProcessError with the full log
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise KernelUnavailable(
            f"building prunekit's {ext.description} failed ({first}); rerun `prunekit kernels build --verbose` "
            f"to see the compiler output (build folder {build_dir})."
        ) from exc
    return build_dir / f"{name}.so"


MAIN = Extension(
    namespace=NAMESPACE,
    prefix="prunekit_kernels",
    csrc_dir=CSRC_DIR,
    sources=SOURCES,
    headers=HEADERS,
    probe="spmm_csr_tiled",
    description="CUDA kernels",
)
"""The SpMM/SDDMM library (``prunekit_ext``); other modules declare theirs next to their Python wrappers."""


def extensions() -> list[Extension]:
    """Every extension prunekit ships (imports the modules that declare them), main library first."""
    from . import ks, nm24, spdnn_cuda, structured

    return [MAIN, structured.EXTENSION, nm24.EXTENSION, ks.EXTENSION, spdnn_cuda.EXTENSION]


def is_loaded() -> bool:
    """True when the ``prunekit_ext`` operators are registered in this process."""
    return extension_loaded(MAIN)


def loaded_library() -> Path | None:
    """Path of the main library loaded by :func:`load` in this process (for the exporter to copy), or None."""
    return _registry.get(MAIN.namespace)


def loaded_libraries() -> dict[str, Path]:
    """namespace -> path of every library this module loaded in this process."""
    return dict(_registry)


def copy_prebuilt(dest_dir: Path) -> Path | None:
    """Copy every shippable library loaded in this process into ``dest_dir`` under its key name (for a package).

    A later load in a process with the same sources, torch, CUDA and archs finds them when ``dest_dir`` is
    ``$PRUNEKIT_KERNEL_PREBUILT`` or the ``prebuilt/`` folder beside this module. Returns the main library's copy
    (or the first copy when the main library was not loaded), or None when nothing was copied.
    """
    shippable = {e.namespace for e in _shippable()}
    copied: dict[str, Path] = {}
    for namespace, path in _registry.items():
        if namespace not in shippable or not Path(path).is_file():
            continue
        dest_dir = Path(dest_dir)
        dest_dir.mkdir(parents=True, exist_ok=True)
        target = dest_dir / Path(path).name
        if Path(path).resolve() != target.resolve():
            shutil.copy2(path, target)
        copied[namespace] = target
    from . import fastcall

    module = fastcall.loaded_path()  # the fast-call module, for this Python version (its key says which)
    if module is not None and module.is_file():
        dest_dir = Path(dest_dir)
        dest_dir.mkdir(parents=True, exist_ok=True)
        if module.resolve() != (dest_dir / module.name).resolve():
            shutil.copy2(module, dest_dir / module.name)
        copied[fastcall.PREFIX] = dest_dir / module.name
    return copied.get(MAIN.namespace) or next(iter(copied.values()), None)


def _shippable() -> list[Extension]:
    try:
        return [e for e in extensions() if e.prebuilt]
    except ImportError:  # a package runtime without one of the modules
        return [MAIN]


def current_key() -> str:
    """The main library's build key for this process's torch, CUDA and visible GPU."""
    return MAIN.key()


def library_name(key: str) -> str:
    """Main library (and .so file stem) name for a build key."""
    return f"{MAIN.prefix}_{key[:16]}"


def _prebuilt(key: str) -> Path | None:
    for folder in _prebuilt_dirs():
        candidate = folder / f"{library_name(key)}.so"
        if candidate.is_file():
            return candidate
    return None


def load(verbose: bool = False) -> Path | None:
    """Make the ``prunekit_ext`` operators (SpMM/SDDMM) available, building the extension if needed.

    Returns:
        Path of the loaded library, or None when another copy registered the operators first.

    Raises:
        KernelUnavailable: no CUDA torch, no GPU of sm_80 or newer, no nvcc/ninja, or the compilation failed.
    """
    return load_extension(MAIN, verbose)


def load_all(verbose: bool = False, parallel: bool = True) -> dict[str, Path | None]:
    """Load (building if needed, side by side: :func:`build_many`) every shippable extension, then the fast-call module
    (``fastcall.load``: the runtime's eager entries; None under its key where it cannot be built, which never raises);
    namespace -> library path.

    Raises:
        KernelUnavailable: as :func:`build_many`, for the first library that cannot be built or loaded.
    """
    from . import fastcall

    paths = build_many(_shippable(), verbose, parallel)
    fastcall.load()
    paths[fastcall.PREFIX] = fastcall.loaded_path()
    return paths
