"""Worker for test_balance.py: one gloo rank of the chained SpDNN driver with survivor balancing (CPU emulation).

Run under ``python -m torch.distributed.run --standalone --nproc_per_node=2 balance_worker.py OUT CASE LAYER``. Every
rank builds the same small network and the same global input set; rank 0 takes the first ``cut`` inputs, rank 1 the
rest, and the ranks even out their live rows before layer LAYER. CASE ``uneven``: 300 / 100 of 400 inputs. CASE
``empty``: rank 1 holds only all-zero inputs, which die in the first chain, so it runs its schedule with no input of
its own until the exchange hands it survivors. Rank 0 writes OUT (JSON): each rank's returned global indices and the
exchange record, and the single-process result. CASE ``gathers``: as ``uneven``, through the driver's ``gathers``
mode (the chain op's calling convention: the live rows are passed as ``rows`` instead of compacted).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from prunekit.kernels.spdnn_cuda import emulate_tiled, infer_chained
from prunekit.spdnn.balance import Balance
from prunekit.spdnn.generator import SPDNN_RELU_CAP, bias_for, iter_layers, synthetic_images
from prunekit.spdnn.reference import dense_features
from prunekit.spdnn.run import build_ell

N, LAYERS, COUNT = 256, 40, 400


def gathered_op(y, idx, val, bias, cap, row_pos, rows):
    """The chain op's convention over the tiled emulation: ``rows`` (or all rows of ``y``) are the live inputs, and the
    output and flags have one row per live input."""
    assert row_pos is None
    return emulate_tiled(y if rows is None else y.index_select(0, rows), idx, val, bias, cap)


def main() -> None:
    out, case, layer = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    images, pixels = synthetic_images(N, COUNT, total_nnz=int(0.25 * N * COUNT))
    real = dense_features(images, pixels, COUNT, N).float()
    if case in ("uneven", "gathers"):
        features, cut = real, 300
    else:
        features, cut = torch.cat([real, torch.zeros(40, N)]), COUNT
    ell_idx, ell_val, _ = build_ell(iter_layers(N, LAYERS, "cpu"), LAYERS, N, "cpu", slot_order=False)
    bias = bias_for(N)
    lo, hi = (0, cut) if rank == 0 else (cut, features.shape[0])
    trace: list[dict] = []
    gathers = case == "gathers"
    live = infer_chained(
        gathered_op if gathers else emulate_tiled, features[lo:hi], ell_idx, ell_val, bias, SPDNN_RELU_CAP,
        trace=trace, balance=Balance(lo, layer), gathers=gathers,
    )  # fmt: skip
    record = [t["balanced"] for t in trace if "balanced" in t]
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {"live": live.tolist(), "balanced": record, "rank": rank})
    if rank == 0:
        single = infer_chained(emulate_tiled, features, ell_idx, ell_val, bias, SPDNN_RELU_CAP)
        with open(out, "w") as f:
            json.dump({"ranks": parts, "single": single.tolist()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
