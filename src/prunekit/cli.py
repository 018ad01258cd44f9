"""The ``prunekit`` command line: thin Typer commands over the library, rendered with rich."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .errors import PrunekitError

if __name__ == "__main__":  # pragma: no cover - `python -m prunekit.cli`
    # Run as a script, this file is `__main__`, not the `prunekit.cli` module that the sub-command modules import
    # (a circular import once they mount): hand the call over to that module, as `python -m prunekit` does.
    from prunekit.cli import main as _main

    _main()
    sys.exit(0)

app = typer.Typer(
    help="Prune neural networks, convert them to kernel-ready sparse formats, export, run and report.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Piped output (CI logs, files) gets a width that fits the report tables; terminals keep their own.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


def _setup_logging() -> None:
    """Route prunekit's library warnings to stderr through rich (once per process)."""
    logger = logging.getLogger("prunekit")
    if not any(isinstance(h, RichHandler) for h in logger.handlers):
        logger.addHandler(RichHandler(console=err_console, show_path=False, show_time=False))
        logger.setLevel(logging.WARNING)
        logger.propagate = False


def handle_errors(fn):
    """Turn a PrunekitError into one red line on stderr and exit status 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _setup_logging()
        try:
            return fn(*args, **kwargs)
        except PrunekitError as exc:
            err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None

    return wrapper


@contextlib.contextmanager
def progress_bar(description: str) -> Iterator:
    """A rich progress bar; yields a ``(done, total, name)`` callback for the library."""
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    ) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, total=total)

        yield update


Overwrite = Annotated[bool, typer.Option("--overwrite", help="Replace OUT if it exists.")]


def _token_counts(text: str) -> list[int]:
    try:
        counts = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise PrunekitError(f"--tune-tokens {text!r}: expected integers like 128,2048") from None
    if not counts:
        raise PrunekitError(f"--tune-tokens {text!r}: give at least one token count")
    return counts


@app.command()
@handle_errors
def prune(
    checkpoint: Annotated[Path, typer.Argument(help="HF model dir, .safetensors file, or .pt/.bin state dict.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Output path (same kind as the input).")],
    pattern: Annotated[str, typer.Option("--pattern", "-p", help="unstructured | block:RxC | N:M (e.g. 2:4).")],
    sparsity: Annotated[
        float | None, typer.Option("--sparsity", "-s", help="Fraction of zeros in [0, 1); implied by N:M.")
    ] = None,
    method: Annotated[
        str, typer.Option(help="magnitude | wanda | sparsegpt (the last two run an HF model on calibration text).")
    ] = "magnitude",
    include: Annotated[
        list[str] | None, typer.Option(help="Regex of tensors to prune (repeatable); replaces the default selection.")
    ] = None,
    exclude: Annotated[list[str] | None, typer.Option(help="Regex of tensors to keep dense (repeatable).")] = None,
    calib: Annotated[
        Path | None,
        typer.Option(help="Calibration text for wanda/sparsegpt: text lines or JSON lines with 'text'."),
    ] = None,
    calib_samples: Annotated[
        int, typer.Option(help="Calibration sequences (default corpus: Python stdlib docstrings).")
    ] = 128,
    device: Annotated[
        str | None, typer.Option(help="Where wanda/sparsegpt run, one block at a time (default: cuda if present).")
    ] = None,
    overwrite: Overwrite = False,
) -> None:
    """Prune a checkpoint's linear (and conv) weights to a sparsity pattern."""
    from .prune import prune_checkpoint

    with progress_bar("pruning") as update:
        result = prune_checkpoint(
            checkpoint,
            output,
            pattern,
            sparsity,
            method,
            include,
            exclude,
            overwrite,
            update,
            calibration=calib,
            calib_samples=calib_samples,
            device=device,
        )
    mean = sum(t.sparsity for t in result.pruned) / len(result.pruned)
    console.print(f"pruned {len(result.pruned)} tensors to {pattern} (mean sparsity {mean:.1%}) -> {result.output}")
    if result.skipped:
        console.print(f"[yellow]skipped {len(result.skipped)} tensors that cannot take {pattern}[/]")


@app.command()
@handle_errors
def convert(
    pruned: Annotated[Path, typer.Argument(help="Pruned checkpoint (from `prunekit prune`).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Output .safetensors file.")],
    fmt: Annotated[str, typer.Option("--format", "-f", help="csr | bsr | nm | bitmask | dense | auto.")] = "auto",
    overwrite: Overwrite = False,
) -> None:
    """Convert pruned weights to kernel-ready sparse formats in one safetensors file."""
    from .deploy.convert import convert_checkpoint
    from .deploy.report import human_bytes

    with progress_bar("converting") as update:
        result = convert_checkpoint(pruned, output, fmt, overwrite, update)
    table = Table(title=f"{output}")
    for col in ("tensor", "format", "bytes", "dense bytes"):
        table.add_column(col, justify="left" if col in ("tensor", "format") else "right")
    for e in result.entries:
        if e.pattern is not None:
            table.add_row(e.name, e.format, str(e.nbytes), str(e.dense_nbytes))
    console.print(table)
    console.print(
        f"total {human_bytes(result.nbytes)} ({result.nbytes} bytes) vs dense {human_bytes(result.dense_nbytes)}"
    )


@app.command()
@handle_errors
def export(
    pruned: Annotated[Path, typer.Argument(help="Pruned checkpoint (from `prunekit prune`).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Package directory to create.")],
    fmt: Annotated[str, typer.Option("--format", "-f", help="csr | bsr | nm | bitmask | dense | auto.")] = "auto",
    kernels: Annotated[
        bool,
        typer.Option("--kernels", help="Ship the CUDA kernels built here (same torch/CUDA/GPU arch on the target)."),
    ] = False,
    tune: Annotated[
        bool | None,
        typer.Option(
            "--tune/--no-tune",
            help="Search the 2:4 layers' cuSPARSELt configurations on this GPU and store them in the package "
            "(default: where a CUDA GPU and cuSPARSELt are present).",
        ),
    ] = None,
    tune_tokens: Annotated[
        str | None,
        typer.Option(help="Token counts (N) to search for, comma-separated, each >= 128 (default 128,256,...,8192)."),
    ] = None,
    overwrite: Overwrite = False,
) -> None:
    """Export a deployable package: manifest, weights, config, runtime and REPORT.md."""
    from .deploy.export import export_package
    from .deploy.report import human_bytes

    tokens = _token_counts(tune_tokens) if tune_tokens is not None else None
    with progress_bar("exporting") as update:
        result = export_package(pruned, output, fmt, overwrite, update, kernels=kernels, tune=tune, tune_tokens=tokens)
    conv = result.convert
    console.print(
        f"package {result.output}: {human_bytes(conv.nbytes)} of weights (dense {human_bytes(conv.dense_nbytes)})"
    )
    if result.tuning_note:
        console.print(result.tuning_note)


@app.command("run")
@handle_errors
def run_cmd(
    package: Annotated[Path, typer.Argument(help="Package directory (from `prunekit export`).")],
    text: Annotated[
        list[str] | None, typer.Option("--text", "-t", help="Input text (repeatable), HF text models.")
    ] = None,
    input_file: Annotated[
        Path | None, typer.Option("--input", "-i", help="safetensors of inputs: model kwargs (HF) or layer name -> x.")
    ] = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Save the outputs to this .safetensors file.")
    ] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    overwrite: Overwrite = False,
) -> None:
    """Load a package (every sha256 verified first) and run it on text or input tensors."""
    from .deploy.runtime import load, run
    from .io import atomic_path
    from .io.checkpoint import open_checkpoint
    from .io.safetensors_io import save_tensors

    if not text and input_file is None:
        raise PrunekitError("give --text or --input")
    if output is not None and output.exists() and not overwrite:
        raise PrunekitError(f"output {output} already exists (pass --overwrite to replace it)")
    inputs = None
    if input_file is not None:
        ckpt = open_checkpoint(input_file)
        inputs = {name: ckpt.get(name) for name in ckpt.names()}
    loaded = load(package, device=device)
    outputs = run(loaded, texts=text, inputs=inputs)
    table = Table(title=f"outputs of {package}")
    for col in ("output", "shape", "dtype", "first values"):
        table.add_column(col)
    for name, value in outputs.items():
        flat = value.detach().float().reshape(-1)[:6].tolist()
        table.add_row(
            name,
            "x".join(map(str, value.shape)),
            str(value.dtype).removeprefix("torch."),
            " ".join(f"{v:.4f}" for v in flat),
        )
    console.print(table)
    if output is not None:
        with atomic_path(output, overwrite) as tmp:
            save_tensors(tmp, {k: v.detach().cpu().contiguous() for k, v in outputs.items()})
        console.print(f"saved {output}")


def short_names(names: list[str]) -> list[str]:
    """Drop the dotted prefix shared by all names and a trailing ``.weight`` (table display only)."""
    parts = [n.removesuffix(".weight").split(".") for n in names]
    common = 0
    while parts and all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1
    return [".".join(p[common:]) for p in parts]


def render_report(report, title: str | None = None) -> Table:
    """Rich table of a :class:`prunekit.deploy.report.Report`."""
    from .deploy.report import REPORT_FORMATS, human_bytes

    table = Table(title=title or f"memory report: {report.source}", show_footer=True)
    table.add_column("layer", footer="total (pruned layers)")
    table.add_column("shape")
    table.add_column("pattern")
    table.add_column("sparsity", justify="right")
    table.add_column("dense", justify="right", footer=human_bytes(report.pruned_dense_nbytes))
    for name in REPORT_FORMATS:
        total = sum(r.format_nbytes.get(name) or r.dense_nbytes for r in report.rows)
        table.add_column(name, justify="right", footer=human_bytes(total))
    table.add_column("stored", justify="right", footer=human_bytes(report.pruned_stored_nbytes))
    ratio = report.pruned_stored_nbytes / report.pruned_dense_nbytes if report.pruned_dense_nbytes else 1.0
    table.add_column("ratio", justify="right", footer=f"{ratio:.3f}")
    plans = [r.decode_plan_nbytes for r in report.rows if r.decode_plan_nbytes is not None]
    table.add_column("GPU decode plan", justify="right", footer=human_bytes(sum(plans)) if plans else "-")
    for r, name in zip(report.rows, short_names([r.name for r in report.rows])):
        table.add_row(
            name,
            "x".join(map(str, r.shape)),
            r.pattern,
            f"{r.sparsity:.1%}",
            human_bytes(r.dense_nbytes),
            *(human_bytes(r.format_nbytes.get(n)) for n in REPORT_FORMATS),
            f"{r.stored_format} {human_bytes(r.stored_nbytes)}",
            f"{r.ratio:.3f}",
            human_bytes(r.decode_plan_nbytes),
        )
    table.caption = (
        "bytes are exact stored sizes; '-' = the format cannot hold the layer; a format's total counts such layers "
        "dense; GPU decode plan = what the runtime adds in GPU memory beside the stored weight once the layer runs at "
        "decode sizes (N <= 16) on a GPU"
    )
    return table


@app.command()
@handle_errors
def report(
    path: Annotated[Path, typer.Argument(help="Pruned checkpoint or package directory.")],
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the report as JSON here.")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a PNG plot here.")] = None,
) -> None:
    """Per-layer memory report: sparsity and exact bytes in every format, with totals."""
    from .deploy.report import build_report, human_bytes, save_plot
    from .io import atomic_path

    rep = build_report(path)
    console.print(render_report(rep))
    console.print(
        f"whole model: {human_bytes(rep.total_dense_nbytes)} dense -> {human_bytes(rep.total_stored_nbytes)} stored"
    )
    if rep.tuning_note:
        console.print(rep.tuning_note)
    if json_out is not None:
        with atomic_path(json_out, overwrite=True) as tmp:
            tmp.write_text(json.dumps(rep.to_dict(), indent=2) + "\n")
    if plot is not None:
        with atomic_path(plot, overwrite=True) as tmp:
            save_plot(rep, tmp.with_suffix(".png"))
            tmp.with_suffix(".png").replace(tmp)


@app.command()
@handle_errors
def demo(
    workdir: Annotated[
        Path | None, typer.Option(help="Where to write the pruned checkpoints and packages (default: a temp dir).")
    ] = None,
) -> None:
    """The whole path on the real all-MiniLM-L6-v2: prune 3 ways, export, run, report, compare embeddings."""
    from .demo import run_demo
    from .deploy.report import human_bytes

    workdir = workdir or Path(tempfile.mkdtemp(prefix="prunekit-demo-"))
    with console.status("demo") as status:
        result = run_demo(workdir, step=lambda msg: status.update(msg))
    console.print(f"checkpoint {result.checkpoint} ({human_bytes(result.checkpoint_nbytes)}); outputs in {workdir}")
    for run in result.runs:
        console.print(render_report(run.report, title=f"{run.label} ({run.pattern}): {run.package}"))
    table = Table(title="dense vs pruned: sentence embeddings and pipeline cost")
    for col in (
        "pattern",
        "model bytes (dense -> stored)",
        "cosine mean",
        "cosine min",
        "prune+convert+export",
        "peak memory growth",
    ):
        table.add_column(col, justify="right" if col != "pattern" else "left")
    for run in result.runs:
        rep, peak = run.report, run.peak_growth_nbytes
        table.add_row(
            run.label,
            f"{human_bytes(rep.total_dense_nbytes)} -> {human_bytes(rep.total_stored_nbytes)}",
            f"{sum(run.cosine) / len(run.cosine):.4f}",
            f"{min(run.cosine):.4f}",
            f"{run.pipeline_s:.2f} s",
            "n/a" if peak is None else f"{human_bytes(peak)} ({peak / result.checkpoint_nbytes:.2f}x checkpoint)",
        )
    console.print(table)
    console.print(f"{len(result.sentences)} sentences, e.g. {result.sentences[0]!r}")


# Command groups that live in their own modules: (module, command name, help).
SUB_APPS = (
    ("cli_kernels", "kernels", "Build and check the bundled CUDA kernels."),
    ("cli_train", "train", "Recipes, fine-tuning and sensitivity analysis."),
    ("cli_spdnn", "spdnn", "The Sparse DNN Graph Challenge: generate, run, check."),
    ("cli_ks", "ks", "Kronecker-sparse layers: factorize a weight into KS factors."),
)


def _mount_optional() -> None:
    import importlib

    for module_name, name, help_text in SUB_APPS:
        try:
            module = importlib.import_module(f".{module_name}", __package__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__package__}.{module_name}":
                raise
            continue
        app.add_typer(module.app, name=name, help=help_text)


_mount_optional()


def _mount_train_commands() -> None:
    """``finetune``, ``analyze`` and ``recipes`` at the top level too (they live in cli_train.py)."""
    try:
        from . import cli_train
    except ModuleNotFoundError as exc:
        if exc.name != f"{__package__}.cli_train":
            raise
        return
    app.command("finetune")(cli_train.finetune)
    app.command("analyze")(cli_train.analyze)
    app.add_typer(cli_train.recipes_app, name="recipes", help="List and show the shipped pruning recipes.")


_mount_train_commands()


def main() -> None:  # pragma: no cover - console entry point
    app(sys.argv[1:])
