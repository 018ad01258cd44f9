"""Debug: compare the spdnn truth on CPU and CUDA with the fused/tiled kernels and the reference kernel."""
import sys
import torch
from prunekit.spdnn.run import run_network
from prunekit.spdnn.generator import iter_layers, bias_for
from prunekit.spdnn.reference import truth_categories
from prunekit.spdnn.generator import synthetic_image_set

def cats(n, L, inputs, dev):
    src = synthetic_image_set(n, inputs)
    f = src.rows(0, inputs, dev, torch.float64)
    return truth_categories(f, iter_layers(n, L, dev), bias_for(n), [L], 4096)[L]

for n, L, inputs in [(1024, 4, 300), (4096, 120, 3000)][: 1 if len(sys.argv) > 1 else 2]:
    t_cpu = cats(n, L, inputs, "cpu")
    t_gpu = cats(n, L, inputs, "cuda")
    print(n, L, inputs, "truth cpu", t_cpu.numel(), "truth cuda", t_gpu.numel(), "equal", torch.equal(t_cpu, t_gpu))
    for kernel in ("reference", "fused", "tiled"):
        try:
            r = run_network(n, L, synthetic=True, device="cuda", inputs=inputs, kernel=kernel, truth=t_cpu)
            print("  ", kernel, r.categories.numel(), r.passed,
                  "extra", sorted(set(r.categories.tolist()) - set(t_cpu.tolist()))[:10],
                  "missing", sorted(set(t_cpu.tolist()) - set(r.categories.tolist()))[:10])
        except Exception as e:
            print("  ", kernel, "error", e)
    sys.stdout.flush()
