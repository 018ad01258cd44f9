"""benchmarks/lean_compare.py on the CPU: the three comparisons on small synthetic result files shaped as
nm24_sweep.py, bsr.py and spmm.py write them (matching, best setting, ratios, unmatched keys, the CLI and its
errors)."""

from __future__ import annotations

import json

import pytest

from .conftest import load_benchmark


def _module():
    return load_benchmark("lean_compare")


def _sweep_row(m, k, n, kernel, ms, warps=None, chunk_arg="auto", ring="3x8"):
    return {"m": m, "k": k, "n": n, "kernel": kernel, "lean_warps": warps, "chunk_arg": chunk_arg, "ring": ring,
            "decode_gpu_ms": ms, "dense_gpu_ms": 0.00426}  # fmt: skip


def test_nm24_best_lean_setting_against_the_auto_ring_row():
    lc = _module()
    sweep = {
        "results": [
            _sweep_row(3072, 768, 16, "ring", 0.00476),
            _sweep_row(3072, 768, 16, "ring", 0.00400, chunk_arg="16"),  # a forced chunk: not the baseline
            _sweep_row(3072, 768, 16, "lean", 0.00350, "auto"),
            _sweep_row(3072, 768, 16, "lean", 0.00300, "4x2"),
            _sweep_row(768, 3072, 16, "ring", 0.00445),
        ]
    }
    rows = {(r["m"], r["k"], r["n"]): r for r in lc.compare_nm24(sweep)}
    r = rows[(3072, 768, 16)]
    assert r["ring_ms"] == 0.00476 and r["best_setting"] == "4x2" and r["best_ms"] == 0.00300
    assert r["best_vs_ring"] == pytest.approx(0.300 / 0.476) and r["best_vs_dense"] == pytest.approx(4.26 / 3.00)
    assert r["ring_vs_dense"] == pytest.approx(4.26 / 4.76) and r["lean_ms"] == {"auto": 0.0035, "4x2": 0.003}
    no_lean = rows[(768, 3072, 16)]
    assert no_lean["best_setting"] is None and no_lean["best_vs_ring"] is None


def test_bsr_rows_are_matched_and_unmatched_keys_listed():
    lc = _module()
    key = {"m": 4096, "k": 4096, "n": 16, "block": 32, "dtype": "float16"}
    lean = {"results": [
        {**key, "sparsity": 0.95, "static_gpu_ms": 0.004, "dynamic_gpu_ms": 0.0042, "torch_bsr_gpu_ms": 0.00652,
         "layer_wall_ms": 0.02, "dense_gpu_ms": 0.0173, "static_err": 2e-4},
        {**key, "sparsity": 0.9, "static_gpu_ms": 0.005},
    ]}  # fmt: skip
    tiled = {"results": [{**key, "sparsity": 0.95, "static_gpu_ms": 0.00744, "dynamic_gpu_ms": 0.00826,
                          "layer_wall_ms": 0.0619}]}  # fmt: skip
    rows, missing = lc.compare_bsr(lean, tiled)
    assert len(rows) == 1 and missing == [(4096, 4096, 16, 32, 0.9, "float16")]
    r = rows[0]
    assert r["static_lean_vs_tiled"] == pytest.approx(4.0 / 7.44)
    assert r["dynamic_lean_vs_tiled"] == pytest.approx(4.2 / 8.26)
    assert r["triton_vs_lean_static"] == pytest.approx(6.52 / 4.0) and r["layer_tiled_ms"] == 0.0619


def test_bitmap_rows_and_the_cli(tmp_path, capsys):
    lc = _module()
    key = {"dtype": "float16", "m": 3072, "k": 768, "n": 16, "sparsity": 0.9}
    lean = {"rows": [{**key, "bitmap_gpu_ms": 0.003, "dense_gpu_ms": 0.00426, "bitmap_rel_error": 2e-4}],
            "environment": {"env": {"PRUNEKIT_NM24_LEAN": "1"}}}  # fmt: skip
    ring = {"rows": [{**key, "bitmap_gpu_ms": 0.005, "dense_gpu_ms": 0.00426}], "environment": {"env": {}}}
    rows, missing = lc.compare_bitmap(lean, ring)
    assert missing == [] and rows[0]["lean_vs_ring"] == pytest.approx(0.6)
    assert rows[0]["lean_vs_dense"] == pytest.approx(4.26 / 3.0) and rows[0]["ring_vs_dense"] == pytest.approx(4.26 / 5)
    a, b, out = tmp_path / "lean.json", tmp_path / "ring.json", tmp_path / "cmp.json"
    a.write_text(json.dumps(lean))
    b.write_text(json.dumps(ring))
    assert lc.main(["bitmap", str(a), str(b), "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["kind"] == "bitmap" and written["rows"][0]["lean_ms"] == 0.003
    assert written["meta"][0]["env"] == {"PRUNEKIT_NM24_LEAN": "1"}
    assert "lean / ring" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        lc.main(["bsr", str(a)])  # two files needed
    with pytest.raises(SystemExit, match="cannot read"):
        lc.main(["nm24", str(tmp_path / "missing.json")])
