"""CPU: ``benchmarks/bsr.py``'s ``wall_pair`` times its two contenders in alternating rounds, swaps their order every
round, and reports the median of the per-round ratios (a drift of the GPU's speed during a run falls on both)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bsr  # noqa: E402


class _Clock:
    """A fake perf_counter: each call of a contender advances it by that contender's cost, which grows by
    ``drift`` per call (a GPU slowing down during the run)."""

    def __init__(self, drift: float):
        self.now, self.calls, self.drift, self.log = 0.0, 0, drift, []

    def contender(self, name: str, cost_s: float):
        def call():
            self.now += cost_s * (1.0 + self.drift * self.calls)
            self.calls += 1
            self.log.append(name)

        return call


@pytest.fixture
def clock(monkeypatch):
    c = _Clock(drift=1e-4)
    monkeypatch.setattr(bsr.time, "perf_counter", lambda: c.now)
    monkeypatch.setattr(bsr.torch.cuda, "synchronize", lambda: None)
    return c


def test_wall_pair_alternates_the_order_and_reports_the_median_ratio(clock):
    a = [clock.contender("a", 1e-3)]
    b = [clock.contender("b", 2e-3)]
    out = bsr.wall_pair(a, b, rounds=5, target_s=0.0205)
    assert len(out["a_rounds"]) == len(out["b_rounds"]) == 5
    # after the warm-up calls and the single-call probes, rounds run a-then-b, b-then-a, ... (20 calls of a per
    # loop at 1 ms each, 10 of b at 2 ms, for target_s = 20.5 ms)
    loop_a, loop_b = ["a"] * 20, ["b"] * 10
    rounds = [loop_a + loop_b if r % 2 == 0 else loop_b + loop_a for r in range(5)]
    assert clock.log[4:] == [name for rnd in rounds for name in rnd]
    # b costs twice a; the drift moves both, the per-round ratio stays near 2
    assert out["b_over_a"] == pytest.approx(2.0, rel=0.02)
    assert out["b_ms"] > out["a_ms"] > 0
