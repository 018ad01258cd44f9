"""CPU: the switches ``benchmarks/layer_host.py`` compares its base layer under (``bitmap_floor``, ``env_set``) take
effect inside their block only, and leave nothing behind (a plan cached inside the block once served the layer deciding
after it, so both arms of a comparison ran one kernel)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import layer_host  # noqa: E402

from prunekit.kernels import gpu  # noqa: E402

M, K, N = 4096, 4096, 16
NNZ_98 = int(M * K * 0.02) + 4 * M  # 98% sparse, rows padded: under the bitmap floor at N = 16, over 1/100


def _variant() -> str:
    return gpu.plan_spmm(M, K, N, NNZ_98, 132, "auto", torch.float16).variant


def test_bitmap_floor_decides_inside_the_block_only():
    before = _variant()
    with layer_host.bitmap_floor(100):
        inside = _variant()
    assert (before, inside, _variant()) == ("rowwarp", "bitmap", "rowwarp")
    with layer_host.bitmap_floor(None):  # None keeps the constants
        assert _variant() == "rowwarp"


def test_env_set_sets_and_restores(monkeypatch):
    monkeypatch.setenv("PRUNEKIT_TEST_A", "1")
    monkeypatch.delenv("PRUNEKIT_TEST_B", raising=False)
    with layer_host.env_set({"PRUNEKIT_TEST_A": "0", "PRUNEKIT_TEST_B": "0"}):
        assert os.environ["PRUNEKIT_TEST_A"] == os.environ["PRUNEKIT_TEST_B"] == "0"
    assert os.environ["PRUNEKIT_TEST_A"] == "1" and "PRUNEKIT_TEST_B" not in os.environ
    with layer_host.env_set(None):
        assert os.environ["PRUNEKIT_TEST_A"] == "1"
