"""docs/ENVIRONMENT.md names every ``PRUNEKIT_*`` environment variable the library reads (a string literal in a
Python or C++ source under ``src/``), and no variable the library does not read."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("*.py", "*.cu", "*.cuh", "*.cpp", "*.h")


def _read_by_the_library() -> set[str]:
    names: set[str] = set()
    for pattern in SOURCES:
        for path in (ROOT / "src").rglob(pattern):
            names.update(re.findall(r"\"(PRUNEKIT_[A-Z0-9_]+)\"", path.read_text(errors="replace")))
    return names


def test_environment_doc_lists_every_variable_and_only_those():
    read = _read_by_the_library()
    assert {"PRUNEKIT_KERNEL_CACHE", "PRUNEKIT_NM24_LEAN", "PRUNEKIT_BSR_LEAN"} <= read  # the scan finds them
    documented = set(
        re.findall(r"^\| `(PRUNEKIT_[A-Z0-9_]+)` \|", (ROOT / "docs" / "ENVIRONMENT.md").read_text(), re.M)
    )
    assert read - documented == set(), "read by src/ but not in docs/ENVIRONMENT.md"
    assert documented - read == set(), "in docs/ENVIRONMENT.md but not read by src/"
