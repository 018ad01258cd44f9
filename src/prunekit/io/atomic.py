"""Atomic outputs: everything is written to a temporary sibling path, then renamed into place.

A failure half-way leaves nothing at the output path, and an existing output is only
replaced when the caller asked to overwrite it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ..errors import OutputExistsError, PrunekitError


def check_output(out: Path, overwrite: bool, inputs: tuple[Path, ...] = ()) -> None:
    """Refuse an output that exists (unless ``overwrite``) or that is one of the inputs.

    Raises:
        OutputExistsError: ``out`` exists and ``overwrite`` is False.
        PrunekitError: ``out`` is an input, or lies inside one (the input is never modified).
    """
    resolved = out.resolve()
    for src in inputs:
        src = src.resolve()
        if resolved == src or src in resolved.parents or resolved in src.parents:
            raise PrunekitError(f"output {out} overlaps the input {src}; choose another output path")
    if out.exists() and not overwrite:
        raise OutputExistsError(f"output {out} already exists (pass --overwrite to replace it)")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextlib.contextmanager
def atomic_path(out: Path, overwrite: bool = False, directory: bool = False) -> Iterator[Path]:
    """Yield a temporary path next to ``out``; on success rename it to ``out``, on error delete it.

    Args:
        out: final path (file, or directory when ``directory`` is True).
        overwrite: replace an existing ``out``.
        directory: create the temporary path as an empty directory.

    Raises:
        OutputExistsError: ``out`` exists and ``overwrite`` is False.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise OutputExistsError(f"output {out} already exists (pass --overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{out.name}.tmp-"
    if directory:
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
        tmp.chmod(0o755)
    else:
        fd, name = tempfile.mkstemp(prefix=prefix, dir=out.parent)
        os.close(fd)
        tmp = Path(name)
        tmp.chmod(0o644)
    try:
        yield tmp
    except BaseException:
        _remove(tmp)
        raise
    if out.exists():
        trash = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, trash)
        os.replace(tmp, out)
        _remove(trash)
    else:
        os.replace(tmp, out)
