"""A real-text corpus that works offline: docstrings of Python's standard library.

Calibration (Wanda, SparseGPT), fine-tuning and evaluation need real text, and CI has no
network. Every Python installation ships thousands of hand-written English paragraphs: the
docstrings of its standard library. :func:`stdlib_corpus` imports a fixed list of stdlib
modules (:data:`CORPUS_MODULES`), collects the docstrings of each module and of its public
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
import importlib
import inspect
import json
import re
import warnings
from pathlib import Path

from ..errors import PrunekitError

__all__ = ["CORPUS_MODULES", "DataError", "stdlib_corpus", "calibration_texts", "evaluation_texts", "load_texts"]

# Stdlib modules without import side effects (no GUI, no network at import, no ``this``).
CORPUS_MODULES = (
    "abc argparse ast asyncio base64 bisect bz2 calendar cmd codecs collections colorsys configparser "
    "contextlib copy csv dataclasses datetime decimal difflib dis doctest email enum filecmp fnmatch "
    "fractions ftplib functools getopt gettext glob graphlib gzip hashlib heapq hmac html.parser "
    "http.client http.cookiejar imaplib inspect io ipaddress itertools json locale logging lzma mailbox "
    "math mimetypes mmap multiprocessing netrc numbers operator optparse os pathlib pickle pickletools "
    "poplib pprint pydoc queue quopri random re reprlib sched secrets selectors shelve shlex shutil "
    "signal smtplib socket socketserver sqlite3 ssl statistics string struct subprocess tarfile "
    "tempfile textwrap threading timeit tokenize trace traceback types typing unittest urllib.parse "
    "urllib.request uuid warnings wave weakref xml.dom.minidom xml.etree.ElementTree zipfile zoneinfo"
).split()
HELD_OUT_FRACTION = 0.2
MIN_CHARS, MAX_CHARS = 60, 1000


class DataError(PrunekitError):
    """A text file for calibration, training or evaluation is missing, empty or malformed."""


def _paragraphs(doc: str) -> list[str]:
    out = []
    for block in re.split(r"\n\s*\n", doc):
        lines = [line.strip() for line in block.strip().splitlines()]
        if not lines or any(line.startswith((">>>", "...", "$ ", "%")) for line in lines):
            continue
        text = " ".join(" ".join(lines).split())
        letters = sum(ch.isalpha() or ch == " " for ch in text)
        if MIN_CHARS <= len(text) <= MAX_CHARS and letters >= 0.85 * len(text) and text[0].isupper():
            out.append(text)
    return out


def _docstrings(module) -> list[str]:
    docs = [inspect.getdoc(module) or ""]
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            docs.append(inspect.getdoc(obj) or "")
        if inspect.isclass(obj):
            for attr, member in sorted(vars(obj).items()):
                if not attr.startswith("_") and inspect.isfunction(member):
                    docs.append(inspect.getdoc(member) or "")
    return docs


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def stdlib_corpus() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The docstring corpus, split deterministically.

    Returns:
        ``(calibration, held_out)``: unique prose paragraphs (str), each ordered by sha256.
    """
    seen: set[str] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated stdlib aliases warn when their docstrings are read
        for name in CORPUS_MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            for doc in _docstrings(module):
                seen.update(_paragraphs(doc))
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
