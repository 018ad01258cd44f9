"""Compare the SpDNN float64 truth computed on the CPU and on the GPU, and the kernels against both.

On 2026-11-25 the fused kernel's N=4096 categories (214, at 120/480/1920 layers) failed the benchmark's check
against the float64 truth computed on the GPU, while the float64 reference on this 2-core CPU gave 214 at every L
(in two summation orders, with and without tie snapping). This script shows where the two truths differ:

    PYTHONPATH=src python scripts/debug_spdnn.py --neurons 4096 --layers 120 [--inputs 60000] [--kernels fused]

Prints the truth counts, the inputs on which they disagree (0-based), and each kernel's disagreement with each.
"""

from __future__ import annotations

import argparse
import time

import torch

from prunekit.spdnn.generator import bias_for, iter_layers, synthetic_image_set
from prunekit.spdnn.reference import truth_categories
from prunekit.spdnn.run import _symmetric_difference, run_network


def truth_on(device: str, neurons: int, layers: int, inputs: int) -> torch.Tensor:
    t0 = time.perf_counter()
    features = synthetic_image_set(neurons, inputs).rows(0, inputs, device, torch.float64)
    batch = 4096 if device == "cpu" else inputs
    found = truth_categories(features, iter_layers(neurons, layers, device), bias_for(neurons), [layers], batch)
    print(f"truth on {device}: {found[layers].numel()} categories ({time.perf_counter() - t0:.1f} s)", flush=True)
    return found[layers]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--neurons", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=120)
    parser.add_argument("--inputs", type=int, default=60000)
    parser.add_argument("--kernels", default="fused", help="comma-separated run_network kernels to compare")
    args = parser.parse_args()
    n, layers, inputs = args.neurons, args.layers, args.inputs
    truths = {"cpu": truth_on("cpu", n, layers, inputs)}
    if torch.cuda.is_available():
        truths["cuda"] = truth_on("cuda", n, layers, inputs)
        diff = _symmetric_difference(truths["cpu"], truths["cuda"])
        print(f"cpu vs cuda truth: {diff.numel()} inputs differ: {diff[:20].tolist()}")
        for kernel in args.kernels.split(","):
            r = run_network(n, layers, synthetic=True, device="cuda", inputs=inputs, kernel=kernel, arbitrate=False)
            for name, t in truths.items():
                d = _symmetric_difference(r.categories, t)
                print(
                    f"{kernel}: {r.categories.numel()} categories; vs {name} truth {d.numel()} differ: {d[:20].tolist()}"
                )


if __name__ == "__main__":
    main()
