"""Compile every CUDA/C++ source of prunekit's extensions to an object file, without a GPU.

Runs nvcc (``.cu``) or the host C++ compiler (``.cpp``) with the same flags and ``-gencode`` targets as
``kernels/build.py``'s JIT build, against the installed torch's headers, so compile errors (and, with ``--ptxas``,
register counts and spills) show up on any machine with nvcc, CPU-only torch included: the CPU wheel lacks one
generated header (``c10/cuda/impl/cuda_cmake_macros.h``), which this script stubs in a temporary folder.

    python scripts/compile_check.py                      # every extension, sm_80 + sm_90
    python scripts/compile_check.py --only prunekit_ks --ptxas --archs 90
    python scripts/compile_check.py --source spmm_tc.cu  # one file (name or path suffix)
    python scripts/compile_check.py --source spmm_rowwarp.cu --archs 90 --keep /tmp/obj  # then cuobjdump -sass

Exit status 1 when any source fails; the failing compiler output is printed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from torch.utils import cpp_extension

from prunekit.kernels import build

STUB_HEADER = "c10/cuda/impl/cuda_cmake_macros.h"


def include_flags(stub_dir: Path, extra: tuple[str, ...]) -> list[str]:
    paths = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"], *extra]
    if not any((Path(p) / STUB_HEADER).is_file() for p in paths):
        header = stub_dir / STUB_HEADER
        header.parent.mkdir(parents=True, exist_ok=True)
        header.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        paths.append(str(stub_dir))
    cuda_home = cuda_root()
    if cuda_home:
        paths.append(str(Path(cuda_home) / "include"))
    return [f"-I{p}" for p in paths]


def cuda_root() -> str | None:
    """The CUDA toolkit folder: torch's ``CUDA_HOME`` (None with a CPU-only torch), else ``$CUDA_HOME``, else the
    first of: the folder above the ``bin/`` of the ``nvcc`` on PATH, /usr/local/cuda, /usr/local/cuda-* (newest first)
    whose ``include/`` has cuda_runtime.h (the host compiler needs it for the .cpp sources)."""
    if cpp_extension.CUDA_HOME:
        return cpp_extension.CUDA_HOME
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    nvcc = shutil.which("nvcc")
    candidates = [Path(nvcc).resolve().parent.parent] if nvcc else []
    candidates += [Path("/usr/local/cuda"), *sorted(Path("/usr/local").glob("cuda-*"), reverse=True)]
    return next((str(c) for c in candidates if (c / "include" / "cuda_runtime.h").is_file()), None)


def command(ext: build.Extension, source: str, archs: tuple[str, ...], incs: list[str], ptxas: bool, out: Path):
    defines = ["-DTORCH_EXTENSION_NAME=compile_check", "-D_GLIBCXX_USE_CXX11_ABI=1", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    path = ext.csrc_dir / source
    if source.endswith(".cu"):
        nvcc = str(Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc") if cpp_extension.CUDA_HOME else "nvcc"
        flags = ext.nvcc_flags(archs) + (["-Xptxas", "-v"] if ptxas else [])
        return [
            nvcc,
            "-c",
            "-std=c++17",
            "--compiler-options",
            "-fPIC",
            *flags,
            *incs,
            *defines,
            str(path),
            "-o",
            str(out),
        ]
    cxx = shutil.which("c++") or "g++"
    return [cxx, "-c", "-std=c++17", "-fPIC", "-O2", *incs, *defines, str(path), "-o", str(out)]


def demangle(symbol: str) -> str:
    """A kernel's readable name (``c++filt`` when present), for the ``--ptxas`` report."""
    tool = shutil.which("c++filt")
    if tool is None:
        return symbol
    return subprocess.run([tool, symbol], capture_output=True, text=True).stdout.strip() or symbol


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", help="extension namespace (repeatable), e.g. prunekit_structured")
    parser.add_argument("--source", action="append", help="only sources whose path ends with this (repeatable)")
    parser.add_argument("--archs", default="80,90", help="compute capabilities, comma-separated (default 80,90)")
    parser.add_argument("--ptxas", action="store_true", help="print ptxas register/spill lines (-Xptxas -v)")
    parser.add_argument("-j", "--jobs", type=int, default=2)
    parser.add_argument(
        "--keep", type=Path, help="copy each object file into this folder (for `cuobjdump -sass`: the kernels' SASS)"
    )
    args = parser.parse_args(argv)
    archs = tuple(a.strip().replace(".", "") for a in args.archs.split(",") if a.strip())
    if cpp_extension.CUDA_HOME is None and shutil.which("nvcc") is None:
        print("no nvcc found (set CUDA_HOME)", file=sys.stderr)
        return 1
    exts = build.extensions()
    from prunekit.kernels import structured

    folder = structured.cusparselt_dir()
    if folder is not None:
        exts.append(structured.cslt_extension(folder))
    else:
        print("skipping the cuSPARSELt binding: no nvidia-cusparselt headers here")
    if args.only:
        exts = [e for e in exts if e.namespace in args.only]
    jobs = []
    with tempfile.TemporaryDirectory(prefix="prunekit-compile-check-") as tmp:
        tmp_dir = Path(tmp)
        for ext in exts:
            incs = include_flags(tmp_dir / "stub", ext.include_paths)
            for source in ext.sources:
                if args.source and not any(str(ext.csrc_dir / source).endswith(s) for s in args.source):
                    continue
                obj = tmp_dir / f"{ext.namespace}-{source.replace('/', '_')}.o"
                jobs.append((ext.namespace, source, command(ext, source, archs, incs, args.ptxas, obj)))

        def run(job):
            start = time.perf_counter()
            proc = subprocess.run(job[2], capture_output=True, text=True)
            return job, proc, time.perf_counter() - start

        failed = 0
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            for (namespace, source, cmd), proc, elapsed in pool.map(run, jobs):
                ok = proc.returncode == 0
                failed += not ok
                print(f"{'ok  ' if ok else 'FAIL'} {namespace}/{source} ({elapsed:.0f} s)", flush=True)
                if ok and args.keep is not None:
                    args.keep.mkdir(parents=True, exist_ok=True)
                    obj = Path(cmd[-1])
                    shutil.copy2(obj, args.keep / obj.name)
                output = proc.stdout + proc.stderr
                if not ok:
                    print(output)
                elif args.ptxas:
                    for line in output.splitlines():
                        if "Compiling entry function" in line:
                            print("  " + demangle(line.split("'")[1]))
                        elif "registers" in line or (
                            "bytes stack frame" in line and any(int(v) for v in re.findall(r"(\d+) bytes", line))
                        ):  # a stack frame or spills that are not all zero
                            print("    " + line.strip())
    print(f"{len(jobs) - failed} of {len(jobs)} sources compiled for sm_{',sm_'.join(archs)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
