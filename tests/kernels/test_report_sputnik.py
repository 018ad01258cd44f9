"""benchmarks/report_sputnik.py on the CPU: the per-(N, sparsity) table from a small synthetic sputnik_compare.py
result file (ranges, counts of points where prunekit is as fast or faster, missing ratios, filters) and its CLI."""

from __future__ import annotations

import json

import pytest

from .conftest import load_benchmark


def _module():
    return load_benchmark("report_sputnik")


def _row(m, k, n, sparsity, row_major, linear, sputnik_ms, ours_linear_ms, variant="direct"):
    row = {"m": m, "k": k, "n": n, "sparsity": sparsity, "prunekit_variant": variant, "sputnik_fp16_ms": sputnik_ms,
           "prunekit_linear_ms": ours_linear_ms, "prunekit_vs_sputnik_fp16": row_major}  # fmt: skip
    if linear is not None:
        row["prunekit_linear_vs_sputnik_fp16_linear"] = linear
    return row


ROWS = [
    _row(4096, 4096, 64, 0.95, 0.77, 0.89, 0.0132, 0.0223),
    _row(11008, 4096, 64, 0.95, 0.76, 1.08, 0.0240, 0.0200, "rowwarp"),
    _row(4096, 4096, 64, 0.98, 1.20, None, 0.0073, 0.0050),
    _row(768, 3072, 16, 0.95, 0.86, 2.14, 0.0067, 0.0051, "bitmap"),
]


def test_summary_table_ranges_counts_and_kernels():
    rs = _module()
    lines = rs.summary_table(ROWS).splitlines()
    assert lines[0].startswith("| N | sparsity | shapes | row-major | nn.Linear |")
    body = {tuple(cell.strip() for cell in line.strip("|").split("|")[:2]): line for line in lines[2:]}
    assert list(body) == [("16", "0.95"), ("64", "0.95"), ("64", "0.98")]
    row = [c.strip() for c in body[("64", "0.95")].strip("|").split("|")]
    assert row[2] == "2"
    assert row[3] == "0.76-0.77x (0 of 2)"
    assert row[4] == "0.89-1.08x (1 of 2)"
    # Sputnik in its own layout over prunekit in nn.Linear's: 13.2 / 22.3 and 24.0 / 20.0
    assert row[5] == f"{0.0132 / 0.0223:.2f}-{0.0240 / 0.0200:.2f}x (1 of 2)"
    assert row[6] == "direct, rowwarp"
    missing = [c.strip() for c in body[("64", "0.98")].strip("|").split("|")]
    assert missing[3] == "1.20-1.20x (1 of 1)" and missing[4] == "-"


def test_summary_table_filters_and_empty_selection():
    rs = _module()
    table = rs.summary_table(ROWS, shapes={(4096, 4096)}, ns={64}, sparsities={0.98})
    assert len(table.splitlines()) == 3 and "| 64 | 0.98 | 1 |" in table
    with pytest.raises(ValueError, match="no result row"):
        rs.summary_table(ROWS, ns={128})


def test_cli_prints_the_table_and_rejects_bad_input(tmp_path, capsys):
    rs = _module()
    path = tmp_path / "sputnik.json"
    path.write_text(json.dumps({"meta": {"device": "H100", "torch": "2.11", "date_utc": "2026-11-27"}, "rows": ROWS}))
    rs.main([str(path), "--shapes", "768x3072"])
    out = capsys.readouterr().out
    assert out.startswith("sputnik.json: H100, torch 2.11, 2026-11-27") and "| 16 | 0.95 | 1 |" in out
    for argv, message in (
        ([str(tmp_path / "missing.json")], "is not a sputnik_compare.py result file"),
        ([str(path), "--shapes", "4096"], "--shapes takes MxK"),
        ([str(path), "--ns", "x"], "--ns takes integers"),
        ([str(path), "--ns", "128"], "no result row matches"),
    ):
        with pytest.raises(SystemExit, match=message):
            rs.main(argv)
