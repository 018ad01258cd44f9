"""``prunekit kernels ...``: prebuild the CUDA extension and check every op against its reference.

A thin Typer sub-app (mounted by ``cli.py``): it parses options, calls ``prunekit.kernels.build`` /
``prunekit.kernels.check`` and renders with rich. Errors a user can act on (``PrunekitError``) print one red line and
exit 1.
"""

from __future__ import annotations

import logging

import typer
from rich.console import Console
from rich.table import Table

from .errors import PrunekitError

app = typer.Typer(help="Build and check prunekit's CUDA kernels.", no_args_is_help=True)
console = Console()


def _fail(exc: PrunekitError) -> None:
    console.print(f"[red]error:[/red] {exc}")
    raise typer.Exit(1)


@app.command()
def build(verbose: bool = typer.Option(False, "--verbose", "-v", help="Show the compiler output.")) -> None:
    """Compile the CUDA extension and the fast-call module into the kernel cache (or load them if already built)."""
    from .kernels import build as kbuild
    from .kernels import fastcall

    if verbose:
        logging.basicConfig(level=logging.INFO)
    try:
        with console.status("building prunekit CUDA kernels (first build takes a few minutes)..."):
            path = kbuild.load(verbose=verbose)
    except PrunekitError as exc:
        _fail(exc)
    console.print(f"[green]kernels ready[/green]: {path or 'already loaded in this process'}")
    console.print(f"cache: {kbuild.cache_root()}  key: {kbuild.current_key()[:16]}")
    with console.status("building prunekit's fast-call module (about a minute the first time)..."):
        module = fastcall.load()
    if module is None:
        console.print("fast-call module: unavailable (eager calls use torch.ops; see the warning above)")
    else:
        console.print(f"fast-call module: {fastcall.loaded_path()}")


@app.command()
def check(seed: int = typer.Option(0, help="Random seed of the inputs.")) -> None:
    """Build, run every op on CUDA against its float64 reference on random inputs, print a table."""
    from .kernels import check as kcheck

    try:
        with console.status("building and checking prunekit CUDA kernels..."):
            results = kcheck.run_checks(seed=seed)
    except PrunekitError as exc:
        _fail(exc)
    table = Table(title="prunekit kernels vs float64 reference (output poisoned with NaN first)")
    for col in ("op", "variant", "dtype", "X layout", "M x K x N", "rel. error", "tolerance", "first call ms", "ok"):
        table.add_column(col, justify="right" if col in ("rel. error", "tolerance", "first call ms") else "left")
    for r in results:
        table.add_row(
            r.op,
            r.variant,
            r.dtype,
            r.layout,
            r.shape,
            f"{r.rel_error:.2e}",
            f"{r.tolerance:.0e}",
            f"{r.elapsed_ms:.2f}",
            "[green]pass[/green]" if r.passed else "[red]FAIL[/red]",
        )
    console.print(table)
    failed = sum(not r.passed for r in results)
    if failed:
        console.print(f"[red]{failed} of {len(results)} checks failed[/red]")
        raise typer.Exit(1)
    console.print(f"[green]all {len(results)} checks passed[/green]")
