"""``prunekit train ...`` (and the top-level ``recipes``, ``finetune``, ``analyze``): thin Typer commands.

Each command parses options, calls one library function (:mod:`prunekit.recipes`,
:mod:`prunekit.prune.finetune`, :mod:`prunekit.prune.analyze`) and renders the result with rich.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.syntax import Syntax
from rich.table import Table

from .cli import Overwrite, console, err_console, handle_errors

app = typer.Typer(help="Recipes, fine-tuning and sensitivity analysis.", no_args_is_help=True)
recipes_app = typer.Typer(help="List and show the shipped pruning recipes.", no_args_is_help=True)
app.add_typer(recipes_app, name="recipes")


@recipes_app.command("list")
@handle_errors
def recipes_list() -> None:
    """List the shipped recipes."""
    from .recipes import list_recipes, recipes_dir

    table = Table(title=f"recipes in {recipes_dir()}")
    for col in ("name", "method", "targets", "schedule", "steps", "description"):
        table.add_column(col)
    for r in list_recipes():
        targets = ", ".join(
            f"{t.pattern}" + (f"@{t.sparsity:g}" if t.sparsity is not None else "") for t in r.prune.targets
        )
        steps = str(r.finetune.steps) if r.finetune else "0"
        table.add_row(r.name, r.method_label, targets, r.prune.schedule.kind, steps, r.description)
    console.print(table)


@recipes_app.command("show")
@handle_errors
def recipes_show(name: Annotated[str, typer.Argument(help="Recipe name (see `recipes list`) or a YAML file.")]) -> None:
    """Show a recipe, validated, with every default filled in."""
    from .recipes import load_recipe

    recipe = load_recipe(name)
    text = yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
    console.print(Syntax(text, "yaml", theme="ansi_dark", background_color="default"))


@app.command()
@handle_errors
def finetune(
    checkpoint: Annotated[Path, typer.Argument(help="Hugging Face model directory (dense or pruned).")],
    recipe: Annotated[str, typer.Option("--recipe", "-r", help="Recipe name or YAML file.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Output model directory.")],
    data: Annotated[
        Path | None, typer.Option(help="Training text: lines or JSON lines with 'text' (default: stdlib docstrings).")
    ] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from OUTPUT.state/ after a kill.")] = False,
    steps: Annotated[
        int | None, typer.Option(help="Override the recipe's steps (schedule and warmup scale with it).")
    ] = None,
    teacher: Annotated[Path | None, typer.Option(help="Dense teacher (default: the unpruned source).")] = None,
    device: Annotated[str | None, typer.Option(help="cuda or cpu (default: cuda if present).")] = None,
    precision: Annotated[
        str | None,
        typer.Option(
            help="Override the recipe's finetune.precision: auto (bf16 autocast on CUDA, fp32 on CPU), "
            "bf16, fp16 (with loss scaling) or fp32."
        ),
    ] = None,
    overwrite: Overwrite = False,
) -> None:
    """Prune by a recipe and fine-tune with exact masks (GMP, distillation); resumable.

    Several GPUs: `torchrun --nproc-per-node N --no-python prunekit finetune ...` trains one DDP replica per
    GPU on a share of every batch; rank 0 shows progress and writes states and the output.
    """
    import os

    from .prune.finetune import finetune_checkpoint

    shown = os.environ.get("RANK", "0") == "0"
    with Progress(
        TextColumn("[bold]fine-tuning"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=err_console,
        transient=True,
        disable=not shown,
    ) as bar:
        task = bar.add_task("finetune", total=None, loss="-")

        def update(done: int, total: int, loss: float) -> None:
            bar.update(task, completed=done, total=total, loss=f"{loss:.4f}")

        result = finetune_checkpoint(
            checkpoint, recipe, output, data, resume, overwrite, steps, teacher, device, update, precision
        )
    if result.rank != 0:
        return
    mean = sum(t.sparsity for t in result.pruned) / max(1, len(result.pruned))
    resumed = f", resumed from step {result.resumed_from}" if result.resumed_from is not None else ""
    last = f", final loss {result.losses[-1]:.4f}" if result.losses else ""
    ranks = f" on {result.world_size} processes" if result.world_size > 1 else ""
    console.print(
        f"{result.steps} steps ({result.precision}{ranks}){resumed}{last}; {len(result.pruned)} tensors at mean "
        f"sparsity {mean:.1%} in {result.elapsed_s:.1f} s -> {result.output}"
    )


@app.command()
@handle_errors
def analyze(
    checkpoint: Annotated[Path, typer.Argument(help="Hugging Face model directory.")],
    pattern: Annotated[str, typer.Option("--pattern", "-p", help="unstructured | block:RxC | N:M.")] = "unstructured",
    sparsities: Annotated[
        str, typer.Option(help="Comma-separated sparsities to sweep (ignored for N:M).")
    ] = "0.3,0.5,0.7,0.9",
    method: Annotated[str, typer.Option(help="magnitude | wanda | sparsegpt.")] = "magnitude",
    allocate: Annotated[
        float | None, typer.Option(help="Derive per-group sparsities whose parameter-weighted mean is this.")
    ] = None,
    data: Annotated[
        Path | None, typer.Option(help="Held-out text (default: the stdlib corpus' held-out split).")
    ] = None,
    samples: Annotated[int, typer.Option(help="Held-out texts to measure on.")] = 64,
    plot: Annotated[Path | None, typer.Option(help="PNG plot path (default: sensitivity.png).")] = Path(
        "sensitivity.png"
    ),
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
) -> None:
    """Sensitivity: prune one layer group at a time over a sweep, measure the output error, plot it."""
    import json

    from .io import atomic_path
    from .prune.analyze import analyze_checkpoint, save_plot

    values = _floats(sparsities)
    with Progress(
        TextColumn("[bold]analyzing"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    ) as bar:
        task = bar.add_task("analyze", total=None)
        result = analyze_checkpoint(
            checkpoint,
            pattern,
            values,
            method=method,
            data=data,
            samples=samples,
            allocate=allocate,
            progress=lambda done, total, name: bar.update(task, completed=done, total=total),
        )
    table = Table(title=f"sensitivity of {checkpoint} to {result.pattern} ({result.metric}, lower is better)")
    table.add_column("group")
    table.add_column("params", justify="right")
    for s in result.sparsities:
        table.add_column(f"{s:.0%}", justify="right")
    if result.allocation:
        table.add_column("allocated", justify="right")
    for group in result.groups:
        row = [group.name, f"{group.params:,}", *(f"{e:.4f}" for e in group.errors)]
        if result.allocation:
            row.append(f"{result.allocation[group.name]:.0%}")
        table.add_row(*row)
    console.print(table)
    if result.allocation:
        console.print(f"allocation: parameter-weighted mean sparsity {result.allocated_mean:.1%}")
    if plot is not None:
        with atomic_path(plot, overwrite=True) as tmp:
            save_plot(result, tmp.with_suffix(".png"))
            tmp.with_suffix(".png").replace(tmp)
        console.print(f"plot -> {plot}")
    if json_out is not None:
        with atomic_path(json_out, overwrite=True) as tmp:
            tmp.write_text(json.dumps(result.to_dict(), indent=2) + "\n")


def _floats(text: str) -> list[float]:
    from .errors import PatternError

    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise PatternError(f"--sparsities must be comma-separated numbers, got {text!r}") from None
