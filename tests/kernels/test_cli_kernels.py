"""The ``kernels`` Typer sub-app: without a GPU both commands print one red line and exit 1."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from prunekit.cli_kernels import app


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
@pytest.mark.parametrize("command", ["build", "check"])
def test_kernels_commands_fail_cleanly_without_gpu(command):
    result = CliRunner().invoke(app, [command])
    assert result.exit_code == 1
    assert "error:" in result.output and "unavailable" in result.output
    assert "Traceback" not in result.output


@pytest.mark.cuda
def test_kernels_check_passes_on_gpu():
    result = CliRunner().invoke(app, ["check"])
    assert result.exit_code == 0, result.output
    assert "checks passed" in result.output
