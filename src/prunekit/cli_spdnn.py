"""``prunekit spdnn``: the Sparse DNN Graph Challenge (generate data, run networks, check, report TE/s)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.table import Table

from .cli import console, handle_errors, progress_bar
from .errors import PrunekitError

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _layer_counts(text: str) -> list[int]:
    try:
        counts = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise PrunekitError(f"--layers {text!r}: expected integers like 120,480,1920") from None
    if not counts or min(counts) < 1:
        raise PrunekitError(f"--layers {text!r}: layer counts must be positive")
    return counts


@app.command()
@handle_errors
def generate(
    out: Annotated[Path, typer.Option("--out", "-o", help="Data directory (official layout).")],
    neurons: Annotated[
        int, typer.Option("--neurons", "-n", help="N: 1024, 4096, 16384 or 65536 (any 16 x 2^k).")
    ] = 1024,
    layers: Annotated[
        str, typer.Option("--layers", "-l", help="Layer counts whose truth categories to write, e.g. 120,480,1920.")
    ] = "120",
    inputs: Annotated[int, typer.Option(help="Number of synthetic input images.")] = 60000,
    device: Annotated[str, typer.Option(help="Device for the float64 truth run (cpu or cuda).")] = "cpu",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace existing files.")] = False,
) -> None:
    """Write a challenge network (TSV, bit for bit the official recipe), synthetic inputs and truth categories."""
    from .spdnn.run import generate as generate_data

    with progress_bar("generating") as update:
        result = generate_data(
            out, neurons, _layer_counts(layers), inputs, device, overwrite, lambda _m, d, t: update(d, t, "")
        )
    console.print(
        f"N={neurons}: {result.layers} layers, {result.inputs} inputs ({result.image_nnz} non-zeros) -> {out}"
    )
    for count, n_cat in result.categories.items():
        console.print(f"  L={count}: {n_cat} categories")


@app.command()
@handle_errors
def run(
    neurons: Annotated[int, typer.Option("--neurons", "-n", help="N.")] = 1024,
    layers: Annotated[str, typer.Option("--layers", "-l", help="Layer counts to run, e.g. 120,480,1920.")] = "120",
    data: Annotated[Path | None, typer.Option(help="Challenge data directory (official or generated).")] = None,
    synthetic: Annotated[
        bool, typer.Option("--synthetic", help="Build layers and inputs in memory from the recipe.")
    ] = False,
    device: Annotated[str, typer.Option(help="cpu (reference, slow) or cuda.")] = "cpu",
    dtype: Annotated[str, typer.Option(help="float32 | float64 | float16 | bfloat16.")] = "float32",
    inputs: Annotated[int | None, typer.Option(help="Use only the first INPUTS inputs.")] = None,
    kernel: Annotated[str, typer.Option(help="auto | fused (CUDA chain kernel) | reference (torch.sparse).")] = "auto",
    categories_out: Annotated[Path | None, typer.Option(help="Write the categories found here (1-based).")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
) -> None:
    """Run challenge networks; print time, TeraEdges/s and PASS/FAIL against the truth categories."""
    from .spdnn.run import run_network
    from .spdnn.tsv import write_categories

    if dtype not in DTYPES:
        raise PrunekitError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    results = []
    for count in _layer_counts(layers):
        with progress_bar(f"N={neurons} L={count}") as update:
            results.append(
                run_network(
                    neurons,
                    count,
                    data,
                    synthetic,
                    device,
                    DTYPES[dtype],
                    inputs,
                    lambda _m, d, t: update(d, t, ""),
                    kernel,
                )
            )
    table = Table(title=f"Sparse DNN challenge, N={neurons}, {device}, {dtype}, kernel {results[0].kernel}")
    for col in ("layers", "inputs", "categories", "build (s)", "inference (s)", "TeraEdges/s", "check"):
        table.add_column(col, justify="right")
    for r in results:
        check = "no truth" if r.passed is None else ("[green]PASS[/]" if r.passed else "[red]FAIL[/]")
        table.add_row(
            str(r.layers),
            str(r.inputs),
            str(r.categories.numel()),
            f"{r.build_s:.2f}",
            f"{r.inference_s:.3f}",
            f"{r.teraedges_per_s:.4f}",
            check,
        )
    console.print(table)
    if categories_out is not None:
        write_categories(categories_out, results[-1].categories, overwrite=True)
    if json_out is not None:
        rows = [
            {k: v for k, v in vars(r).items() if k != "categories"}
            | {"n_categories": int(r.categories.numel()), "teraedges_per_s": r.teraedges_per_s}
            for r in results
        ]
        json_out.write_text(json.dumps(rows, indent=2) + "\n")
    if any(r.passed is False for r in results):
        raise typer.Exit(1)
