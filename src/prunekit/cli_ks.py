"""``prunekit ks``: Kronecker-sparse layers (Gonon et al. 2024, arXiv 2405.15013): factorise weights into chains."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from .cli import console, handle_errors, progress_bar

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


@app.callback()
def ks() -> None:
    """Kronecker-sparse layers: factorise weights into chains of KS factors (Gonon et al. 2024)."""


@app.command()
@handle_errors
def factorize(
    checkpoint: Annotated[Path, typer.Argument(help="HF model dir, .safetensors file, or .pt/.bin state dict.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Output path (same kind as the input).")],
    pattern: Annotated[
        str, typer.Option("-p", "--pattern", help="Chain ks:a,b,c,d/a,b,c,d/... (K_1 first), or one factor ks:a,b,c,d.")
    ],
    sweeps: Annotated[int, typer.Option(help="Alternating-least-squares sweeps after the hierarchical start.")] = 10,
    include: Annotated[list[str] | None, typer.Option("--include", help="Regex of tensors to factorise.")] = None,
    exclude: Annotated[list[str] | None, typer.Option("--exclude", help="Regex of tensors to keep.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUT if it exists.")] = False,
) -> None:
    """Factorise weights into a chain of Kronecker-sparse factors; print each tensor's relative error.

    The output holds each factorised weight as the dense product K_1 ... K_L (an ordinary checkpoint) and records
    pattern and error in its prunekit.json; `prunekit convert` / `export` then store the factors in the ks format.
    """
    from .errors import PrunekitError
    from .prune.kronecker import factorize_checkpoint

    if sweeps < 0:
        raise PrunekitError(f"--sweeps must be >= 0, got {sweeps}")
    with progress_bar("factorizing") as update:
        result = factorize_checkpoint(checkpoint, output, pattern, sweeps, include, exclude, overwrite, update)
    table = Table(title=f"{result.pattern} -> {output}")
    table.add_column("tensor")
    table.add_column("relative error", justify="right")
    for name, err in result.errors.items():
        table.add_row(name, f"{err:.3e}")
    console.print(table)
    if result.skipped:
        console.print(f"{len(result.skipped)} tensors skipped (shape does not fit {result.pattern})")
