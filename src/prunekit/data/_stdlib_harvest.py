"""Harvest prose paragraphs from the docstrings of a fixed list of stdlib modules (stdlib only).

Run as a script in a fresh interpreter (``python -I _stdlib_harvest.py``) by :func:`prunekit.data.corpus.stdlib_corpus`:
what the caller's process has imported cannot change the result (torch.package, for one, replaces
``inspect.getfile`` when imported, which removed that function's docstring from an in-process harvest).
Prints the paragraphs as a JSON list on stdout.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import sys
import warnings

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
MIN_CHARS, MAX_CHARS = 60, 1000


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


def harvest() -> list[str]:
    """Unique prose paragraphs of :data:`CORPUS_MODULES` (modules that fail to import are skipped), sorted."""
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
    return sorted(seen)


if __name__ == "__main__":
    json.dump(harvest(), sys.stdout)
