"""A real-text corpus that works offline: docstrings of Python's standard library.

Calibration (Wanda, SparseGPT), fine-tuning and evaluation need real text, and CI has no
network. Every Python installation ships thousands of hand-written English paragraphs: the
docstrings of its standard library. :func:`stdlib_corpus` imports a fixed list of stdlib
modules (:data:`CORPUS_MODULES`) in a fresh interpreter (``_stdlib_harvest.py``, so the caller's imports cannot
change the text), collects the docstrings of each module and of its public
classes, functions and methods (``inspect.getdoc``), splits them into paragraphs, and keeps
prose paragraphs (no doctest lines, 60 to 1000 characters, mostly letters).

The split into calibration and held-out evaluation sets is a function of the text alone: a
paragraph whose sha256 falls in the first 20% of the hash space is held out
(:data:`HELD_OUT_FRACTION`). Each set is ordered by sha256, which interleaves modules. The
corpus is therefore deterministic for a given Python version (docstrings change between
versions; the figures in docs/QUALITY.md name the version they were measured with).

User text comes from :func:`load_texts`: a file of text lines, or JSON lines with a ``text``
field.
"""

from __future__ import annotations

import functools
import hashlib
import json
import subprocess
import sys
from pathlib import Path

from ..errors import PrunekitError
from ._stdlib_harvest import CORPUS_MODULES

__all__ = ["CORPUS_MODULES", "DataError", "stdlib_corpus", "calibration_texts", "evaluation_texts", "load_texts"]

HELD_OUT_FRACTION = 0.2


class DataError(PrunekitError):
    """A text file for calibration, training or evaluation is missing, empty or malformed."""


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _harvest_fresh() -> list[str]:
    """The paragraphs harvested by ``_stdlib_harvest.py`` in a fresh, isolated interpreter (``-I``).

    Raises:
        DataError: the harvest process failed.
    """
    proc = subprocess.run(
        [sys.executable, "-I", str(Path(__file__).with_name("_stdlib_harvest.py"))],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise DataError(f"harvesting the stdlib docstring corpus failed: {last}")
    return json.loads(proc.stdout)


@functools.lru_cache(maxsize=1)
def stdlib_corpus() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The docstring corpus, split deterministically.

    Returns:
        ``(calibration, held_out)``: unique prose paragraphs (str), each ordered by sha256.
    """
    seen = _harvest_fresh()
    cut = int(HELD_OUT_FRACTION * 16**8)
    ordered = sorted(seen, key=_digest)
    held_out = tuple(t for t in ordered if int(_digest(t)[:8], 16) < cut)
    calibration = tuple(t for t in ordered if int(_digest(t)[:8], 16) >= cut)
    return calibration, held_out


def calibration_texts(n: int | None = None) -> list[str]:
    """The first ``n`` calibration paragraphs (all when None)."""
    texts = stdlib_corpus()[0]
    return list(texts if n is None else texts[:n])


def evaluation_texts(n: int | None = None) -> list[str]:
    """The first ``n`` held-out paragraphs (all when None); never used for calibration or training."""
    texts = stdlib_corpus()[1]
    return list(texts if n is None else texts[:n])


def load_texts(path: str | Path, limit: int | None = None) -> list[str]:
    """Read texts from a file: one text per non-empty line, or JSON lines with a ``text`` field.

    A file is read as JSON lines when its suffix is ``.jsonl`` or its first non-empty line
    starts with ``{``.

    Raises:
        DataError: missing/unreadable file, no text, a line that is not JSON or lacks a
            string ``text`` field (the message names the line number).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"text file not found: {path}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read as UTF-8 text ({exc})") from None
    numbered = [(i + 1, line.strip()) for i, line in enumerate(lines) if line.strip()]
    if not numbered:
        raise DataError(f"{path}: no text in the file")
    as_json = path.suffix == ".jsonl" or numbered[0][1].startswith("{")
    texts = []
    for lineno, line in numbered:
        if as_json:
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise DataError(f"{path}:{lineno}: expected an object with a string 'text' field")
            line = record["text"]
        texts.append(line)
        if limit is not None and len(texts) >= limit:
            break
    return texts
