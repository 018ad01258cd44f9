"""Fine-tuning under torchrun (DDP, 2 CPU processes over gloo): identical replicas, exact masks, one writer, resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from prunekit.io import open_checkpoint
from prunekit.prune.finetune import rank_share, state_path

from .test_finetune import GMP_RECIPE, TEXTS

# Every rank runs three calls in one torchrun launch: a full run (the library initialises and destroys
# the process group, as under `torchrun ... prunekit finetune`), then, in process groups the worker
# makes itself, a run killed after step 3 (state at step 2) and its resume. Instrumentation (by wrapping module functions) records, on every rank and
# after every step, a digest of the student's weights and masks and whether every masked weight is
# exactly zero; and how often each rank wrote a training state or an output.
WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist
    import prunekit.prune.finetune as ft

    ckpt, recipe_file, texts_file, work = sys.argv[1:5]
    rank = int(os.environ["RANK"])
    texts = json.loads(open(texts_file).read())
    recipe = ft.load_recipe(recipe_file)
    seen = {"student": None, "masks": None, "writes": 0, "states": []}

    build = ft.build_hf_model
    def build_hf_model(path, *args, **kwargs):
        model = build(path, *args, **kwargs)
        if seen["student"] is None:
            seen["student"] = model  # the first model built is the student, the second the teacher
        return model
    ft.build_hf_model = build_hf_model

    apply = ft._apply_masks
    def apply_masks(modules, masks):
        seen["masks"] = masks  # the run's mask dict (updated in place, also by the broadcast)
        return apply(modules, masks)
    ft._apply_masks = apply_masks

    write = ft.write_checkpoint
    def write_checkpoint(*args, **kwargs):
        seen["writes"] += 1
        return write(*args, **kwargs)
    ft.write_checkpoint = write_checkpoint

    save = ft._save_state
    def save_state(path, recipe, step, *args):
        seen["states"].append(step)
        return save(path, recipe, step, *args)
    ft._save_state = save_state

    def run(name, kill_at=None, resume=False, store=None):
        if store:  # the caller's own process group (torch cannot re-initialise through torchrun's store)
            dist.init_process_group("gloo", init_method=f"file://{os.path.join(work, store)}", rank=rank, world_size=2)
        seen.update(student=None, masks=None, writes=0, states=[])
        steps = []
        def progress(done, total, loss):
            modules = dict(seen["student"].named_modules())
            exact = all(bool((modules[n].weight[~m] == 0).all()) for n, m in seen["masks"].items())
            steps.append({"done": done, "exact": exact, "digest": ft._replica_digest(seen["student"], seen["masks"])})
            if done == kill_at:
                raise KeyboardInterrupt
        record = {"steps": steps}
        try:
            result = ft.finetune_checkpoint(ckpt, recipe, os.path.join(work, name), data=texts, resume=resume,
                                            progress=progress)
            record.update(losses=result.losses, resumed_from=result.resumed_from, rank=result.rank,
                          world_size=result.world_size, digest=result.replica_digest, pruned=len(result.pruned))
        except KeyboardInterrupt:
            record["killed"] = True
        record.update(writes=seen["writes"], states=seen["states"], group_left=dist.is_initialized())
        if store:
            dist.destroy_process_group()
        return record

    report = {
        "full": run("full"),  # as the CLI does: finetune_checkpoint joins the group and destroys it
        "killed": run("resumed", kill_at=3, store="store-killed"),
        "resumed": run("resumed", resume=True, store="store-resumed"),
    }
    with open(os.path.join(work, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    """
)

needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)


def test_rank_shares_are_disjoint_and_cover_the_batch():
    batch = list(range(100, 132))
    shares = [rank_share(batch, r, 4) for r in range(4)]
    assert sorted(i for s in shares for i in s) == batch
    assert {len(s) for s in shares} == {8}
    assert rank_share(batch, 0, 1) == batch


@needs_gloo
def test_torchrun_two_ranks_identical_exact_single_writer_and_resume(tmp_path, tiny_bert_tok):
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(GMP_RECIPE.replace("checkpoint_every: 1", "checkpoint_every: 2"))
    texts_file = tmp_path / "texts.json"
    texts_file.write_text(json.dumps(TEXTS))
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(worker), str(tiny_bert_tok), str(recipe_file), str(texts_file), str(work)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(2)]

    for report in ranks:
        full = report["full"]
        assert [s["done"] for s in full["steps"]] == [1, 2, 3, 4, 5, 6]
        assert all(s["exact"] for s in full["steps"])  # pruned weights exactly zero after every step
        assert full["world_size"] == 2 and len(full["losses"]) == 6
        assert all(torch.isfinite(torch.tensor(full["losses"])))
        assert report["killed"]["killed"] and [s["done"] for s in report["killed"]["steps"]] == [1, 2, 3]
        assert report["resumed"]["resumed_from"] == 2
        assert [s["done"] for s in report["resumed"]["steps"]] == [3, 4, 5, 6]
    r0, r1 = ranks
    # Replicas hold identical weights and masks after every step, and the same (mean) losses.
    for phase in ("full", "killed", "resumed"):
        assert [s["digest"] for s in r0[phase]["steps"]] == [s["digest"] for s in r1[phase]["steps"]], phase
    assert r0["full"]["digest"] == r1["full"]["digest"] == r0["full"]["steps"][-1]["digest"]
    assert r0["full"]["losses"] == r1["full"]["losses"]
    # The group the library made is destroyed at the end; a caller's group is left to the caller.
    assert [r[p]["group_left"] for r in ranks for p in ("full", "killed", "resumed")] == [False, True, True] * 2
    # Rank 0 alone writes training states and the output; rank 1 writes nothing.
    assert (r0["full"]["writes"], r1["full"]["writes"]) == (1, 0)
    assert (r0["full"]["states"], r1["full"]["states"]) == ([2, 4], [])
    assert (r0["killed"]["writes"], r0["killed"]["states"], r1["killed"]["states"]) == (0, [2], [])
    assert (r0["resumed"]["writes"], r1["resumed"]["writes"], r0["resumed"]["states"]) == (1, 0, [4])
    assert r0["full"]["pruned"] == 12 and r1["full"]["pruned"] == 0
    # Resuming continues at step 3 and is bit-identical to the uninterrupted run (per-rank RNG restored).
    assert r0["resumed"]["losses"] == r0["full"]["losses"][2:]
    assert [s["digest"] for s in r0["resumed"]["steps"]] == [s["digest"] for s in r0["full"]["steps"][2:]]
    full, resumed = open_checkpoint(work / "full"), open_checkpoint(work / "resumed")
    assert full.names() == resumed.names()
    for name in full.names():
        assert torch.equal(full.get(name), resumed.get(name)), name
    sidecar = json.loads((work / "full" / "prunekit.json").read_text())
    assert len(sidecar["tensors"]) == 12
    for name, entry in sidecar["tensors"].items():  # the final patterns, exactly
        keep = full.get(name) != 0
        if entry["pattern"] == "block:4x4":
            blocks = keep.reshape(keep.shape[0] // 4, 4, keep.shape[1] // 4, 4).sum(dim=(1, 3))
            assert bool(((blocks == 0) | (blocks == 16)).all()) and int((blocks == 0).sum()) == blocks.numel() // 2
        else:
            assert int((~keep).sum()) == round(0.75 * keep.numel()), name
    assert not state_path(work / "full").parent.exists() and not state_path(work / "resumed").parent.exists()
