"""Kernel tests: ``@pytest.mark.cuda`` tests skip cleanly when no CUDA GPU is visible."""

from __future__ import annotations

import pytest
import torch


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
