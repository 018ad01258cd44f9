"""Several GPUs: even out the live inputs across ranks once they have settled (the SpDNN chained driver).

Hidayetoglu et al. (HPEC 2020, sec. IV) give every GPU a fixed 1/G share of the inputs. In the challenge networks
most inputs die in the first layers and the survivors (about 3% of them) then run through all the remaining layers,
so the run's time is that of the rank whose share happened to keep the most survivors. At N = 16384 x 1920 on two
H100s, one share kept 454 of the 880 survivors, the other 426 (benchmarks/results/spdnn-split-16384-h100-2026-11-25-
order.json). Once no input has died for a whole chain (the driver's settle point), every rank hands its surplus live
rows to the ranks short of them, so that each holds an equal contiguous piece of the concatenated live rows in rank
order. One ``all_to_all_single`` moves the feature rows and one their global input indices; every other row stays.

The collectives need every rank at the same point of the same schedule: until the exchange, the driver makes each
chain decision from all ranks' counts (:meth:`Balance.exchange`), and a rank with no live input still takes part.
"""

from __future__ import annotations

import os
import time

import torch

BALANCE_ENV = "PRUNEKIT_SPDNN_BALANCE"  # "0": every rank keeps its own survivors to the end


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
        group: the process group (default: the world).
    """

    def __init__(self, offset: int, group=None):
        import torch.distributed as dist

        self.offset = offset
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.before: list[int] | None = None  # live rows per rank when the exchange ran
        self.after: list[int] | None = None
        self.seconds = 0.0  # host time in this object's collectives, waits for the other ranks included
        self.calls: list[tuple[str, float]] = []  # (exchange / rebalance, seconds) per collective call

    def exchange(self, lost: bool, live: int, device: torch.device) -> tuple[bool, list[int]]:
        """All ranks' chain outcome: ``(some rank lost an input, live rows per rank)``; a collective (every rank,
        same call order). ``device``: the tensors' device (CUDA for NCCL, CPU for gloo)."""
        import torch.distributed as dist

        t0 = time.perf_counter()
        mine = torch.tensor([int(lost), live], dtype=torch.int64, device=device)
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(parts, mine, group=self.group)
        pairs = torch.stack(parts).tolist()
        self.calls.append(("exchange", time.perf_counter() - t0))
        self.seconds += self.calls[-1][1]
        return any(p[0] for p in pairs), [p[1] for p in pairs]

    def rebalance(self, y: torch.Tensor, ids: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Move live rows so that every rank holds an equal share (:func:`share_splits`); a collective.

        Args:
            y: ``(counts[rank], N)`` this rank's live feature rows, any dtype. ids: ``(counts[rank],)`` int64, their
                global input indices, ascending. counts: every rank's live rows (from :meth:`exchange`).

        Returns:
            ``(y, ids)`` of this rank's new share, rows in the same (rank, then local) order.
        """
        import torch.distributed as dist

        t0 = time.perf_counter()
        send, recv = share_splits(counts, self.rank)
        self.before = list(counts)
        self.after = [sum(share_splits(counts, r)[1]) for r in range(self.world)]
        y = y.contiguous()
        out = y.new_empty((sum(recv), *y.shape[1:]))
        dist.all_to_all_single(out, y, recv, send, group=self.group)
        out_ids = ids.new_empty(sum(recv))
        dist.all_to_all_single(out_ids, ids.contiguous(), recv, send, group=self.group)
        if out.is_cuda:  # the time of the exchange itself (the caller synchronizes at its next step anyway)
            torch.cuda.current_stream(out.device).synchronize()
        self.calls.append(("rebalance", time.perf_counter() - t0))
        self.seconds += self.calls[-1][1]
        return out, out_ids
