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
    """Compile every prunekit CUDA library side by side into the kernel cache (or load it if already built), then the
    fast-call module; print each library's path."""
    from .kernels import build as kbuild
    from .kernels import fastcall, structured

    if verbose:
        logging.basicConfig(level=logging.INFO)
    cslt = structured.cslt_extension_here()
    exts = [*kbuild.extensions(), *([cslt] if cslt else [])]
    try:
        with console.status("building prunekit's CUDA libraries side by side (a few minutes the first time)..."):
            paths = kbuild.build_many(exts, verbose=verbose)
    except PrunekitError as exc:
        _fail(exc)
    with console.status("building prunekit's fast-call module (about a minute the first time)..."):
        module = fastcall.load()
    table = Table(title=f"prunekit CUDA libraries (cache {kbuild.cache_root()})")
    table.add_column("library")
    table.add_column("path")
    for ext in exts:
        path = paths.get(ext.namespace)
        table.add_row(ext.namespace, str(path) if path else "already loaded in this process")
    table.add_row(
        fastcall.PREFIX, str(fastcall.loaded_path()) if module else "unavailable (eager calls use torch.ops; see above)"
    )
    console.print(table)
    console.print(f"[green]kernels ready[/green]: {len(exts)} libraries, key {kbuild.current_key()[:16]}")


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
