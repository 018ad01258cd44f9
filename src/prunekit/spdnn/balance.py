"""Several GPUs: even out the live inputs across ranks once they have settled (the SpDNN chained driver).

Hidayetoglu et al. (HPEC 2020, sec. IV) give every GPU a fixed 1/G share of the inputs. In the challenge networks
most inputs die in the first layers and the survivors (about 3% of them) then run through all the remaining layers,
so the run's time is that of the rank whose share happened to keep the most survivors. At N = 16384 x 1920 on two
H100s, one share kept 454 of the 880 survivors, the other 426 (benchmarks/results/spdnn-split-16384-h100-2026-11-25-
order.json). At one layer, :data:`BALANCE_LAYER` (64: where the driver's doubling chains 2, 2, 4, ... 32 end, and the
survivors of every challenge network have settled), every rank hands its surplus live rows to the ranks short of
them, so that each holds an equal contiguous piece of the concatenated live rows in rank order. One ``all_gather``
of the counts and two ``all_to_all_single`` (feature rows, global input indices) move them; every other row stays.

One exchange, at a fixed layer, rather than one at a data-dependent settle point: deciding that point together took
a collective after every chain, 0.25-1.13 ms each on two H200s (``benchmarks/spdnn_balance.py``), 3.65-4.14 ms of
a 152 ms run.
"""

from __future__ import annotations

import os
import time

import torch

BALANCE_ENV = "PRUNEKIT_SPDNN_BALANCE"  # "0": every rank keeps its own survivors to the end
BALANCE_LAYER_ENV = "PRUNEKIT_SPDNN_BALANCE_LAYER"  # the layer before which the ranks even out their live rows
BALANCE_LAYER = 64
"""Default layer of the exchange: the first 64 layers run as chains of 2, 2, 4, 8, 16 and 32 (spdnn_cuda.infer_chained),
after which the challenge networks' survivors have settled (docs/PERFORMANCE_SPDNN.md, the per-launch traces)."""


def balance_enabled() -> bool:
    """Whether multi-rank runs even out their survivors (:class:`Balance`); ``$PRUNEKIT_SPDNN_BALANCE=0``: no."""
    return os.environ.get(BALANCE_ENV, "1").strip() not in ("0", "false", "False")


def share_splits(counts: list[int], rank: int) -> tuple[list[int], list[int]]:
    """Rows that ``rank`` sends to and receives from each rank for an equal contiguous share.

    The live rows of all ranks are taken in rank order (rank 0's first); rank r's new share is rows
    ``[total * r // G, total * (r + 1) // G)`` of that sequence, so shares differ by at most one row, and a row that
    already lies in its own rank's new share stays there.

    Args:
        counts: live rows per rank (length G, each >= 0).
        rank: 0 <= rank < G.

    Returns:
        ``(send, recv)``: lists of length G; ``send[d]`` rows of ``rank``'s (in order) go to rank d, and ``recv[s]``
        rows come from rank s (in rank order they make ``rank``'s new share). ``sum(send) == counts[rank]``.

    Raises:
        ValueError: negative counts, or a rank outside ``[0, G)``.
    """
    world = len(counts)
    if not 0 <= rank < world or any(c < 0 for c in counts):
        raise ValueError(f"share_splits: rank {rank} of {world}, counts {counts}")
    starts = [sum(counts[:r]) for r in range(world)]
    total = sum(counts)
    new = [(total * r // world, total * (r + 1) // world) for r in range(world)]

    def overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
        return max(0, min(a[1], b[1]) - max(a[0], b[0]))

    mine = (starts[rank], starts[rank] + counts[rank])
    send = [overlap(mine, new[d]) for d in range(world)]
    recv = [overlap((starts[s], starts[s] + counts[s]), new[rank]) for s in range(world)]
    return send, recv


class Balance:
    """One rank's side of the survivor exchange for one batch of inputs (torch.distributed must be initialised).

    Args:
        offset: global 0-based index of this rank's first input in the batch; the driver then tracks global input
            indices, so that rows may change rank.
        layer: the exchange happens before this layer (0-based; default ``$PRUNEKIT_SPDNN_BALANCE_LAYER`` or
            :data:`BALANCE_LAYER`); none when the network has no more layers than that.
        group: the process group (default: the world).
    """

    def __init__(self, offset: int, layer: int | None = None, group=None):
        import torch.distributed as dist

        self.offset = offset
        self.layer = int(os.environ.get(BALANCE_LAYER_ENV, BALANCE_LAYER)) if layer is None else layer
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.before: list[int] | None = None  # live rows per rank when the exchange ran
        self.after: list[int] | None = None
        self.calls: list[tuple[str, float]] = []  # (counts / rebalance, host seconds) per collective call

    @property
    def seconds(self) -> float:
        """Host seconds in this object's collectives, waits for the other ranks included."""
        return sum(sec for _, sec in self.calls)

    def _counts(self, live: int, device: torch.device) -> list[int]:
        """Every rank's live rows (``all_gather``; tensors on ``device``: CUDA for NCCL, CPU for gloo)."""
        import torch.distributed as dist

        t0 = time.perf_counter()
        mine = torch.tensor([live], dtype=torch.int64, device=device)
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(parts, mine, group=self.group)
        counts = torch.cat(parts).tolist()
        self.calls.append(("counts", time.perf_counter() - t0))
        return counts

    def rebalance(self, y: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Move live rows so that every rank holds an equal share (:func:`share_splits`); collectives that every rank
        calls at the same layer.

        Args:
            y: ``(live, N)`` this rank's live feature rows, any dtype. ids: ``(live,)`` int64, their global input
                indices, ascending.

        Returns:
            ``(y, ids)`` of this rank's new share, rows in the same (rank, then local) order.
        """
        import torch.distributed as dist

        counts = self._counts(y.shape[0], y.device)
        t0 = time.perf_counter()
        send, recv = share_splits(counts, self.rank)
        self.before = counts
        self.after = [sum(share_splits(counts, r)[1]) for r in range(self.world)]
        y = y.contiguous()
        out = y.new_empty((sum(recv), *y.shape[1:]))
        dist.all_to_all_single(out, y, recv, send, group=self.group)
        out_ids = ids.new_empty(sum(recv))
        dist.all_to_all_single(out_ids, ids.contiguous(), recv, send, group=self.group)
        if out.is_cuda:  # the time of the exchange itself (the caller synchronizes at its next step anyway)
            torch.cuda.current_stream(out.device).synchronize()
        self.calls.append(("rebalance", time.perf_counter() - t0))
        return out, out_ids
