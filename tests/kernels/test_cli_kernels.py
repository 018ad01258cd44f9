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


def test_env_setting_is_scoped(monkeypatch):
    """testing.env_setting (the kernels' per-call switches in `kernels check` and the benchmarks): set, or unset with
    None, inside the block only, also when it raises."""
    import os

    from prunekit.kernels.testing import env_setting

    monkeypatch.delenv("PRUNEKIT_TEST_SWITCH", raising=False)
    with env_setting("PRUNEKIT_TEST_SWITCH", "1"):
        assert os.environ["PRUNEKIT_TEST_SWITCH"] == "1"
    assert "PRUNEKIT_TEST_SWITCH" not in os.environ
    monkeypatch.setenv("PRUNEKIT_TEST_SWITCH", "0")
    with pytest.raises(RuntimeError), env_setting("PRUNEKIT_TEST_SWITCH", "1"):
        raise RuntimeError("inside")
    assert os.environ["PRUNEKIT_TEST_SWITCH"] == "0"
    with env_setting("PRUNEKIT_TEST_SWITCH", None):
        assert "PRUNEKIT_TEST_SWITCH" not in os.environ
    assert os.environ["PRUNEKIT_TEST_SWITCH"] == "0"
