"""``prunekit spdnn``: the Sparse DNN Graph Challenge (generate data, run networks, check, report TE/s)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
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
    kernel: Annotated[
        str,
        typer.Option(
            help="auto | fused (shared-memory chain; float32, or --dtype float16 / bfloat16 features) | tiled (any N, "
            "float32) | reference (torch.sparse)."
        ),
    ] = "auto",
    gpus: Annotated[
        int,
        typer.Option(
            help="Ranks: G GPUs (NCCL) or, with --device cpu, G CPU processes (gloo); launched through torchrun."
        ),
    ] = 1,
    repeats: Annotated[int, typer.Option(help="Timed runs after a warm-up (median reported) when > 1.")] = 1,
    categories_out: Annotated[Path | None, typer.Option(help="Write the categories found here (1-based).")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
) -> None:
    """Run challenge networks; print time, TeraEdges/s and PASS/FAIL against the truth categories.

    With --gpus G > 1 the command relaunches itself under torchrun with G processes (or joins the group
    when already started by torchrun); rank 0 prints and writes.
    """
    from .spdnn.run import init_distributed, run_network, shutdown_distributed

    if dtype not in DTYPES:
        raise PrunekitError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    counts = _layer_counts(layers)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if gpus > 1 and world == 1:
        args = ["run", "-n", str(neurons), "-l", layers, "--device", device, "--dtype", dtype, "--kernel", kernel]
        args += ["--gpus", str(gpus), "--repeats", str(repeats)]
        args += ["--synthetic"] if synthetic else ["--data", str(data)] if data is not None else []
        args += ["--inputs", str(inputs)] if inputs is not None else []
        args += ["--categories-out", str(categories_out)] if categories_out is not None else []
        args += ["--json", str(json_out)] if json_out is not None else []
        raise typer.Exit(_relaunch(gpus, args))
    if world != gpus:
        raise PrunekitError(f"--gpus {gpus}, but torchrun started {world} processes")
    rank, _ = init_distributed(device)
    results = []
    try:
        for count in counts:
            bar = progress_bar(f"N={neurons} L={count}") if rank == 0 else contextlib.nullcontext(None)
            with bar as update:
                step = (lambda _m, d, t: update(d, t, "")) if update is not None else None
                results.append(
                    run_network(
                        neurons, count, data, synthetic, device, DTYPES[dtype], inputs, step, kernel, repeats=repeats
                    )
                )
        if rank == 0:
            _report(results, neurons, device, dtype, categories_out, json_out)
    finally:
        shutdown_distributed()
    code = 1 if any(r.passed is False for r in results) else 0
    if world > 1:
        # A torchrun rank leaves with os._exit once its files are written and its output flushed: torch's gloo
        # teardown at interpreter shutdown aborted now and then ("terminate called without an active exception",
        # exit -6, in about 1 of 10 CPU runs of the 2-process test) after runs that had passed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        raise typer.Exit(code)


def _relaunch(gpus: int, args: list[str]) -> int:
    """Run ``python -m prunekit.spdnn ARGS`` under torchrun with ``gpus`` processes; return its exit code."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"]
    cmd += ["-m", "prunekit.spdnn", *args]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(cmd, env=env, check=False).returncode


def _report(results, neurons: int, device: str, dtype: str, categories_out: Path | None, json_out: Path | None):
    table = Table(
        title=f"Sparse DNN challenge, N={neurons}, {device} x {results[0].ranks}, {dtype}, kernel {results[0].kernel}"
    )
    for col in ("layers", "inputs", "categories", "build (s)", "inference (s)", "TeraEdges/s", "check"):
        table.add_column(col, justify="right")
    for r in results:
        check = "no truth" if r.passed is None else ("[green]PASS[/]" if r.passed else "[red]FAIL[/]")
        if r.disputed:  # inputs the first truth got otherwise, settled (or not) by the CPU float64 reference
            check += f" ({r.disputed} disputed{', CPU float64 verdict' if r.arbitrated else ''})"
        table.add_row(
            str(r.layers),
            str(r.inputs),
            str(r.categories.numel()),
            f"{r.build_s:.2f}",
            f"{r.inference_s:.4f}",
            f"{r.teraedges_per_s:.4f}",
            check,
        )
    console.print(table)
    if categories_out is not None:
        from .spdnn.tsv import write_categories

        write_categories(categories_out, results[-1].categories, overwrite=True)
    if json_out is not None:
        rows = [
            {k: v for k, v in vars(r).items() if k != "categories"}
            | {"n_categories": int(r.categories.numel()), "teraedges_per_s": r.teraedges_per_s}
            for r in results
        ]
        json_out.write_text(json.dumps(rows, indent=2) + "\n")


@app.command("export-champion")
@handle_errors
def export_champion(
    data: Annotated[Path, typer.Option(help="Challenge data directory (official layout, TSV).")],
    neurons: Annotated[int, typer.Option("--neurons", "-n", help="N.")] = 1024,
    layers: Annotated[int, typer.Option("--layers", "-l", help="Layers to write (the largest L to run).")] = 1920,
    out: Annotated[Path | None, typer.Option(help="Output folder (default: DATA).")] = None,
) -> None:
    """Write the binary files the 2020 champion's code reads: neuron{N}.bin and sparse-images-{N}.bin."""
    from .spdnn.champion import write_champion_files

    files = write_champion_files(data, neurons, layers, out or data)
    for path in files:
        console.print(f"wrote {path}")
