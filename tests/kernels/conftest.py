"""Kernel tests: ``@pytest.mark.cuda`` tests skip cleanly when no CUDA GPU is visible."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str):
    """The script ``benchmarks/<name>.py`` as a module (the scripts are not a package), registered in ``sys.modules``
    as ``bench_<name>`` so that its dataclasses and pickling work."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def ring_kernel(monkeypatch):
    """The nm24 ring kernel for 2:4 and bitmap calls at N <= 16: the lean kernels take the small-K ones by default
    ($PRUNEKIT_NM24_LEAN's measured rule), and these tests are the ring kernel's. A test that wants the lean kernel
    sets the switch itself."""
    from prunekit.kernels import nm24

    monkeypatch.setenv(nm24.LEAN_ENV, "0")


@pytest.fixture
def tiled_bsr_kernel(monkeypatch):
    """The tiled BSR kernel at N <= 16: the lean decode kernel takes those calls by default ($PRUNEKIT_BSR_LEAN), and
    these tests are the tiled kernel's. A test that wants the lean kernel sets the switch itself."""
    from prunekit.kernels import structured

    monkeypatch.setenv(structured.LEAN_ENV, "0")
