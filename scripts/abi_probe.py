"""Which ways of raising from a C++ torch extension work on this machine (diagnostic; needs a CUDA GPU and a compiler).

Builds ``scripts/abi_probe_cpp.cpp`` (six ops that fail on purpose: a std::string's c_str, std::ostringstream,
snprintf, a std::string argument, a plain std::runtime_error, and TORCH_CHECK with two message parts, which goes
through c10::str's ostringstream) and calls each in its own process, printing the return code and the message. On the
GPU machine's image (2026-11-26) the two ostringstream cases ended with signal 11 and the other four raised
RuntimeError, which is why prunekit's C++ checks use ``PRUNEKIT_CHECK`` (``src/prunekit/kernels/csrc/check.h``).

    python3 scripts/abi_probe.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils import cpp_extension

SOURCE = Path(__file__).with_name("abi_probe_cpp.cpp")
BUILD = Path(os.environ.get("TMPDIR", "/tmp")) / "prunekit_abi_probe"
CASES = ("v1", "v2", "v3", "v4", "v5", "v6")


def main() -> None:
    BUILD.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(name="abi_cpp", sources=[str(SOURCE)], is_python_module=False, build_directory=str(BUILD))
    if len(sys.argv) > 1:  # one case, in this process
        try:
            getattr(torch.ops.abi_c, sys.argv[1])(torch.zeros(3, device="cuda"))
        except Exception as exc:  # the point: which ones raise instead of crashing
            print(sys.argv[1], type(exc).__name__, "raised:", str(exc).splitlines()[0], flush=True)
        return
    for case in CASES:
        result = subprocess.run([sys.executable, __file__, case], capture_output=True, text=True, check=False)
        print(case, "rc", result.returncode, (result.stdout.strip().splitlines() or ["-"])[-1])


if __name__ == "__main__":
    main()
