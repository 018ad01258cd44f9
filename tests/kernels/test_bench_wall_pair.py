"""CPU: ``benchmarks/bsr.py``'s ``wall_pair`` times its two contenders in alternating rounds, swaps their order every
round, and reports the median of the per-round ratios (a drift of the GPU's speed during a run falls on both); its
``overhead_pair`` does the same for a layer's CUDA graph and its eager loops, and reports the median difference."""

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


def test_overhead_pair_alternates_graph_and_eager_rounds_and_reports_the_median_difference(clock, monkeypatch):
    # the device side: a graph of `reps` calls whose replay costs 1 ms per call, drifting like the eager calls
    reps = 4
    kernel = clock.contender("graph", 1e-3 * reps)

    class _Graph:
        def replay(self):
            kernel()

    monkeypatch.setattr(bsr, "capture_graph", lambda calls, target_s: (_Graph(), reps))

    def ms_between(fn):
        start = clock.now
        fn()
        return (clock.now - start) * 1e3

    monkeypatch.setattr(bsr, "_ms_between", ms_between)
    eager = [clock.contender("eager", 1.25e-3)]  # 0.25 ms more per call than the device time
    out = bsr.overhead_pair(eager, rounds=5, replays=3, target_s=0.0102, min_calls=12)
    assert len(out["graph_rounds"]) == len(out["wall_rounds"]) == 5
    # after the warm-up call and the single-call probe: graph-then-eager, eager-then-graph, ... (3 replays per graph
    # step; 12 eager calls per loop: min_calls, over _eager_reps' floor of 10 and the 8 that target_s = 10.2 ms gives
    # at 1.25 ms each)
    device, loop = ["graph"] * 3, ["eager"] * 12
    rounds = [device + loop if r % 2 == 0 else loop + device for r in range(5)]
    assert clock.log[2:] == [name for rnd in rounds for name in rnd]
    assert out["graph_ms"] == pytest.approx(1.0, rel=0.02)
    assert out["wall_ms"] == pytest.approx(1.25, rel=0.02)
    # the drift (1e-4 per call) moves both sides alike: the per-round difference stays near 0.25 ms
    assert out["overhead_us"] == pytest.approx(250.0, rel=0.05)
    rounds_diff = [1e3 * (w - g) for g, w in zip(out["graph_rounds"], out["wall_rounds"], strict=True)]
    assert sorted(rounds_diff)[2] == pytest.approx(out["overhead_us"])


def test_overhead_pair_loops_hold_at_least_min_calls_by_default(clock, monkeypatch):
    # long kernels: target_s would give 8 calls per loop; a loop's one-off costs are then spread over OVERHEAD_MIN_CALLS
    monkeypatch.setattr(
        bsr, "capture_graph", lambda calls, target_s: (type("G", (), {"replay": lambda self: None})(), 1)
    )
    monkeypatch.setattr(bsr, "_ms_between", lambda fn: (fn(), 1.0)[1])
    eager = [clock.contender("eager", 1.25e-3)]
    bsr.overhead_pair(eager, rounds=2, replays=1, target_s=0.0102)
    assert clock.log.count("eager") == 2 + 2 * bsr.OVERHEAD_MIN_CALLS  # warm-up + _eager_reps' probe, two loops


def test_eager_gap_points_parse_with_an_optional_environment_setting():
    import eager_gap

    points = eager_gap.parse_points("bsr:16:4096x11008:4096:0.5,bsr:32:8x4:2:0.9:PRUNEKIT_BSR_XSLABS=0")
    assert points == [
        ("bsr", 16, 4096, 11008, 4096, 0.5, {}),
        ("bsr", 32, 8, 4, 2, 0.9, {"PRUNEKIT_BSR_XSLABS": "0"}),
    ]
    with pytest.raises(ValueError, match="bad point 'bsr:16:4096:1'"):
        eager_gap.parse_points("bsr:16:4096:1")
