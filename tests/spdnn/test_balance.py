"""Survivor balancing across ranks (prunekit.spdnn.balance): the split arithmetic, the batch plan, and two gloo
ranks of the chained driver against one process (CPU emulation of the tiled kernel)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prunekit.spdnn.balance import share_splits
from prunekit.spdnn.run import _batches, partition


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_share_splits_move_rows_into_equal_contiguous_shares(world):
    for counts in itertools.product([0, 1, 5, 17], repeat=world):
        counts = list(counts)
        splits = [share_splits(counts, r) for r in range(world)]
        total = sum(counts)
        for r, (send, recv) in enumerate(splits):
            assert sum(send) == counts[r]  # every row goes somewhere
            assert sum(recv) == total * (r + 1) // world - total * r // world  # the new share's size
            for d in range(world):
                assert send[d] == splits[d][1][r]  # what r sends to d is what d expects from r
        # a row already inside its rank's new share stays: the kept rows are the overlap of old and new ranges
        starts = [sum(counts[:r]) for r in range(world)]
        for r in range(world):
            new = (total * r // world, total * (r + 1) // world)
            kept = max(0, min(starts[r] + counts[r], new[1]) - max(starts[r], new[0]))
            assert splits[r][0][r] == kept
    with pytest.raises(ValueError):
        share_splits([1, -1], 0)
    with pytest.raises(ValueError):
        share_splits([1, 1], 2)


def test_balanced_batches_are_as_many_on_every_rank():
    for count, world, batch in [(60000, 2, 15000), (60001, 2, 15000), (301, 4, 20), (5, 8, 1), (7, 2, 100)]:
        plans = []
        for r in range(world):
            lo, hi = partition(count, r, world)
            plans.append(_batches(hi - lo, batch, count, world, balanced=True))
            assert plans[-1][0][0] == 0 and plans[-1][-1][1] == hi - lo  # the share, covered in order
            assert all(a[1] == b[0] for a, b in zip(plans[-1], plans[-1][1:]))
            assert max(b - a for a, b in plans[-1]) <= batch
        assert len({len(p) for p in plans}) == 1, (count, world, batch)
    assert _batches(10, 4, 20, 2, balanced=False) == [(0, 4), (4, 8), (8, 10)]


@pytest.mark.parametrize(("case", "layer"), [("uneven", 16), ("empty", 16), ("uneven", 10), ("gathers", 10)])
def test_two_gloo_ranks_even_out_the_survivors(tmp_path, case, layer):
    """Rank 0 starts with 300 inputs and rank 1 with 100 (``uneven``), or rank 1 with only all-zero inputs
    (``empty``: it runs its schedule with nothing of its own up to the exchange). The exchange comes where the chains
    of 2, 2, 4, 8 end (layer 16), or inside the chain of 8 (layer 10, inputs still dying). After it the ranks hold
    equal shares of the live rows, and together they return exactly the single process's categories. ``gathers``: the
    chain op's convention (live rows passed as ``rows``, not compacted), as the fused kernel runs."""
    import prunekit

    out = tmp_path / "balance.json"
    worker = Path(__file__).with_name("balance_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker)]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    src = str(Path(prunekit.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run(
        [*cmd, str(out), case, str(layer)], capture_output=True, text=True, timeout=180, cwd=tmp_path,
        env=env | {"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    ranks = sorted(result["ranks"], key=lambda p: p["rank"])
    assert sorted(i for p in ranks for i in p["live"]) == result["single"]
    assert len(result["single"]) > 0
    records = [p["balanced"] for p in ranks]
    assert all(len(r) == 1 for r in records) and records[0] == records[1]  # one exchange, seen alike
    before, after = records[0][0]["before"], records[0][0]["after"]
    assert sum(before) == sum(after) > 0 and max(after) - min(after) <= 1
    assert before != after  # the shares were uneven before
    if case == "empty":
        assert before[1] == 0 and after[1] > 0
    for r, p in enumerate(ranks):
        assert len(p["live"]) <= after[r] and p["live"] == sorted(p["live"])
