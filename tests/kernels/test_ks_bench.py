"""benchmarks/ks.py and benchmarks/ks_report.py on the CPU: the fixed subsample, the part plan, the baselines'
sparse tensors, the authors' generated dispatch, a dry run end to end, and the report's merge / quartile / target /
variant-table logic on a small synthetic result."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

from prunekit.formats.ks import blocks_to_dense
from prunekit.kernels import ks

from .conftest import load_benchmark

bench = load_benchmark("ks")
report = load_benchmark("ks_report")


def test_subsample_file_is_the_documented_draw():
    source = next((p for p in (bench.PATTERNS_FILE, bench.PATTERNS_CARRY) if p.is_file()), None)
    if source is None:
        pytest.skip("the paper's pattern list (shared/data/ks_patterns.txt) is not on this machine")
    quads = bench.read_patterns(source)
    chosen = bench.draw_subsample(quads)
    assert bench.read_patterns(bench.SUBSAMPLE_FILE) == chosen
    assert len(chosen) >= 200 and len(set(chosen)) == len(chosen) and set(chosen) <= set(quads)
    assert {(q[0], q[3]) for q in chosen} == {(q[0], q[3]) for q in quads}  # every (a, d) stratum


def test_draw_subsample_spans_each_group_and_is_seeded():
    quads = [(1, b, b, 1) for b in range(1, 31)] + [(2, 4, 4, 2)]
    chosen = bench.draw_subsample(quads, fraction=0.2, seed=3)
    assert chosen == bench.draw_subsample(quads, fraction=0.2, seed=3)
    group = [q for q in chosen if q[0] == 1]
    assert len(group) == 6 and (2, 4, 4, 2) in chosen
    sizes = [q[1] for q in group]  # one per stratum of 5 consecutive sizes
    assert [(s - 1) // 5 for s in sizes] == list(range(6))


def test_assign_parts_is_a_balanced_deterministic_partition():
    quads = bench.read_patterns(bench.SUBSAMPLE_FILE)
    parts = bench.assign_parts(quads, 4)
    assert parts == bench.assign_parts(quads, 4)
    assert sorted(q for p in parts for q in p) == sorted(quads)
    loads = [sum(bench.estimate_pattern_s(q) for q in p) for p in parts]
    assert max(loads) - min(loads) <= max(bench.estimate_pattern_s(q) for q in quads)
    assert bench.estimate_pattern_s((8, 512, 512, 4)) > bench.estimate_pattern_s((1, 48, 48, 1))


@pytest.mark.parametrize("quad", [(2, 3, 5, 4), (3, 4, 6, 1)])
def test_baseline_sparse_tensors_equal_the_dense_factor(quad):
    a, b, c, d = quad
    blocks = torch.randn(a, d, b, c, dtype=torch.float64)
    dense = blocks_to_dense(blocks)
    assert torch.equal(bench.csr_from_blocks(blocks).to_dense(), dense)
    if d == 1:
        assert torch.equal(bench.bsr_from_blocks(blocks).to_dense(), dense)


def test_authors_dispatch_is_generated_from_their_tuning_files(tmp_path):
    (tmp_path / "kernel.py").write_text(
        "def add_lines_to_instantiate_kernel_with_hp(lines, name, bs, a, b, c, d, prec, tx, tk, ty, x, y, v):\n"
        "    lines.append(f'\\t\\tif (batch_size == {bs} && a == {a}) {{ {name}<{tx},{v}>; break; }}\\n')\n"
        "    return lines\n"
    )
    header = "batch_size a b c d TILEX TILEK TILEY TX TY VSIZE ms std mse\n"
    for name in ("bs_first_half", "bs_last_half", "bs_first_float", "bs_last_float"):
        (tmp_path / f"kernel_{name}.best").write_text(
            header + "25088 1 48 48 1 16 16 128 8 4 2 0 0 0\n25088 1 48 48 1 32 16 128 8 4 4 0 0 0\n"
        )
    quads = [(1, 48, 48, 1), (2, 64, 64, 2)]
    files, missing = bench.authors_sources(tmp_path, quads)
    assert missing == {f"{lay}_{p}": [[2, 64, 64, 2]] for lay in ("bs_first", "bs_last") for p in ("half", "float")}
    part = files["gen_kernel_bs_last_half_0.cu"]
    assert "kernel_bs_last_half<32,4>" in part and "<16,2>" not in part  # VSIZE 4 preferred
    assert "void best_kernel_bs_first_float(float *input" in files["kernel_bs_first_float.cuh"]


def test_dry_run_writes_rows_for_every_contender(tmp_path):
    sub = tmp_path / "sub.txt"
    sub.write_text("# tiny\n2,3,5,1\n1,4,4,2\n")
    out = tmp_path / "part.json"
    bench.main(["--dry-run", "--subsample", str(sub), "--dtypes", "float32", "--out", str(out), "--part", "1/1"])
    data = json.loads(out.read_text())
    assert data["not_run"] == [] and len(data["rows"]) == 4
    for row in data["rows"]:
        assert row["correct"] and row["rel_error"]["f32"] < 1e-5
        assert {"f32", "prunekit", "bmm", "einsum", "dense", "csr"} <= set(row["ms"])
        assert ("bsr" in row["ms"]) == (row["pattern"][3] == 1) and "authors" in row["skipped"]
        assert row["speedup_vs_best"] > 0 and row["floor_fraction"] > 0


def test_dense_is_timed_once_per_shape_and_resumed_rows_are_kept(tmp_path):
    sub = tmp_path / "sub.txt"
    sub.write_text("# two patterns of one shape (4x4), one of another\n1,4,4,1\n4,1,1,1\n1,2,3,2\n")
    first = tmp_path / "a" / "ks-cpu-dryrun-x-part1of1.json"
    argv = ["--dry-run", "--subsample", str(sub), "--dtypes", "float32", "--layouts", "batch_last", "--part", "1/1"]
    bench.main([*argv, "--limit", "1", "--out", str(first)])
    assert len(json.loads(first.read_text())["rows"]) == 1
    second = tmp_path / "b" / "ks-cpu-dryrun-x-part1of1.json"
    bench.main([*argv, "--resume", "--resume-also", str(first), "--shuffle", "3", "--out", str(second)])
    data = json.loads(second.read_text())
    rows = {tuple(r["pattern"]): r for r in data["rows"]}
    assert len(data["rows"]) == 3 and data["order"] == "random.Random(3).shuffle"
    assert rows[(1, 4, 4, 1)] == json.loads(first.read_text())["rows"][0]  # kept, not re-run
    same_shape = rows[(4, 1, 1, 1)]
    assert same_shape["dense_timed_on"] == [1, 4, 4, 1]
    assert same_shape["ms"]["dense"] == rows[(1, 4, 4, 1)]["ms"]["dense"]
    assert "dense_timed_on" not in rows[(1, 2, 3, 2)] and rows[(1, 2, 3, 2)]["ms"]["dense"] > 0
    cache = bench.seed_dense_cache([second, tmp_path / "absent.json"])
    assert set(cache) == {"4x4/float32/batch_last", "4x6/float32/batch_last"}


def test_a_row_that_killed_the_process_is_recorded_and_skipped_on_resume(tmp_path, capsys):
    sub = tmp_path / "sub.txt"
    sub.write_text("# one pattern\n1,4,4,1\n")
    out = tmp_path / "ks-cpu-dryrun-x-part1of1.json"
    crash = {"pattern": [1, 4, 4, 1], "dtype": "float32", "layout": "batch_first", "name": "csr"}
    (tmp_path / (out.name + ".running")).write_text(json.dumps(crash))  # what a process killed inside csr leaves
    argv = ["--dry-run", "--subsample", str(sub), "--dtypes", "float32", "--part", "1/1", "--out", str(out)]
    bench.main([*argv, "--resume"])
    data = json.loads(out.read_text())
    assert data["crashed"] == [crash] and not (tmp_path / (out.name + ".running")).exists()
    assert [r["layout"] for r in data["rows"]] == ["batch_last"]  # the crashed row is not run again
    bench.main([*argv, "--resume"])  # the record survives a later resume
    assert json.loads(out.read_text())["crashed"] == [crash]
    # a contender that hung (the watchdog's marker): only it is skipped, on that row only
    out2 = tmp_path / "b" / out.name
    out2.parent.mkdir()
    hung = {"pattern": [1, 4, 4, 1], "dtype": "float32", "layout": "batch_last", "name": "csr", "hung": True}
    (out2.parent / (out.name + ".running")).write_text(json.dumps(hung))
    bench.main([*argv[:-1], str(out2), "--resume"])
    data = json.loads(out2.read_text())
    assert data["hung"] == [hung] and data["crashed"] == [] and len(data["rows"]) == 2
    rows = {r["layout"]: r for r in data["rows"]}
    assert rows["batch_last"]["skipped"]["csr"] == bench.HUNG and "csr" not in rows["batch_last"]["ms"]
    assert rows["batch_first"]["ms"]["csr"] > 0
    # --single runs one contender alone (what --diagnose runs per contender in a CUDA_LAUNCH_BLOCKING process)
    capsys.readouterr()
    bench.main(["--dry-run", "--single", "1,4,4,1", "float32", "batch_first", "f32"])
    single = json.loads(capsys.readouterr().out.split("SINGLE ", 1)[1])
    assert single["error"] is None and single["ms"] > 0 and single["rel_error"] < 1e-5
    assert bench.contender_names("float16", 1)[-3:] == ["csr", "bsr", "authors"]


def _row(pattern, dtype, layout, ms, correct=True):
    base = {k: v for k, v in ms.items() if k in ("bmm", "einsum", "dense", "bsr")}
    best = min(base, key=base.get)
    variants = {k: v for k, v in ms.items() if k.startswith("tile") or k == "f32"}
    default = "f32" if dtype == "float32" else "tile64_simple"
    ms = {**ms, "prunekit": ms[default], "prunekit_best": min(variants.values())}
    return {
        "pattern": pattern, "dtype": dtype, "layout": layout, "ms": ms, "correct": correct,
        "default_variant": default, "best_baseline": best, "speedup_vs_best": base[best] / ms["prunekit"],
        "speedup_best_variant_vs_best": base[best] / ms["prunekit_best"],
        "speedup_vs_authors": ms["authors"] / ms["prunekit"] if ms.get("authors") else None,
        "floor_fraction": 0.5,
    }  # fmt: skip


def _synthetic(tmp_path):
    fp16 = [  # (pattern, tile64_simple, tile64_pipe, tile128_simple, tile128_pipe, einsum, authors)
        ((1, 48, 48, 1), 1.0, 1.2, 1.5, 1.6, 2.0, 3.0),
        ((1, 48, 64, 1), 1.0, 0.9, 1.5, 1.6, 3.0, 3.0),
        ((1, 40, 64, 1), 1.0, 1.1, 1.5, 1.6, 4.0, 1.0),
        ((2, 256, 256, 1), 2.0, 2.0, 1.0, 1.1, 1.5, 6.0),
    ]
    rows = []
    for p, t64s, t64p, t128s, t128p, ein, auth in fp16:
        ms = {"tile64_simple": t64s, "tile64_pipe": t64p, "tile128_simple": t128s, "tile128_pipe": t128p,
              "einsum": ein, "bmm": ein * 2, "authors": auth}  # fmt: skip
        rows.append(_row(list(p), "float16", "batch_last", ms))
    rows.append(_row([1, 48, 48, 1], "float32", "batch_last", {"f32": 2.0, "einsum": 1.0, "dense": 1.5}, False))
    part1 = {"device": "synthetic", "batch": 8, "part": [1, 2], "ceilings": {}, "rows": rows[:3],
             "part_patterns": [[1, 48, 48, 1], [1, 48, 64, 1], [1, 40, 64, 1]]}  # fmt: skip
    part2 = {"device": "synthetic", "batch": 8, "part": [2, 2], "ceilings": {}, "rows": rows[3:],
             "part_patterns": [[2, 256, 256, 1], [9, 9, 9, 9]]}  # fmt: skip
    paths = [tmp_path / "p1.json", tmp_path / "p2.json"]
    for path, data in zip(paths, (part1, part2)):
        path.write_text(json.dumps(data))
    return paths, rows


def test_report_merge_quartiles_targets_and_variant_table(tmp_path):
    paths, rows = _synthetic(tmp_path)
    merged = report.merge(paths)
    assert len(merged["rows"]) == 5 and merged["not_run"] == [[9, 9, 9, 9]]
    q = report.quartiles([4.0, 1.0, 3.0, 2.0, None])
    assert q["count"] == 4 and q["median"] == 2.5 and q["min"] == 1.0 and q["max"] == 4.0
    assert q["q1"] == statistics.quantiles([1, 2, 3, 4], n=4, method="inclusive")[0] == 1.75
    summary = report.summarize(merged["rows"])
    fp16 = summary["float16/batch_last"]
    assert fp16["vs_best"]["median"] == pytest.approx(statistics.median([2.0, 3.0, 4.0, 0.75]))
    assert fp16["met_vs_best"] is True and fp16["wins"] == 3  # median 2.5 >= 2x
    assert fp16["vs_authors"]["median"] == pytest.approx(statistics.median([3.0, 3.0, 1.0, 3.0]))
    assert fp16["met_vs_authors"] is True and fp16["worst"][0][3] == 0.75
    fp32 = summary["float32/all"]
    assert fp32["met_vs_best"] is False and fp32["all_correct"] is False and fp32["met_vs_authors"] is None
    table = report.variant_table(merged["rows"])
    small = ks.variant_key(48, 48, 1, False)
    assert small == ks.variant_key(40, 64, 1, False)
    # the three b <= 64 rows: tile64_simple ratios 1, 1/0.9, 1 -> geomean 1.036; tile64_pipe 1.2, 1, 1.1 -> 1.097
    assert table[small]["tile_rows"] == 64 and table[small]["pipelined"] is False
    assert table[small]["geomean_ratio"] == pytest.approx(math.exp(math.log(1 / 0.9) / 3))
    assert table[ks.variant_key(256, 256, 1, False)]["tile_rows"] == 128
    text = report.markdown(merged)
    assert "| float16/batch_last | 4 | 2.50x" in text and "1,40,64,1" in text
    literal = report.variant_table_literal(table, "x.json")
    namespace: dict = {}
    exec(literal, namespace)  # the pasted lines are valid Python giving the same table
    assert namespace["MEASURED_VARIANTS"][small] == (64, False)


def test_report_main_writes_merged_json_png_and_markdown(tmp_path):
    paths, _ = _synthetic(tmp_path)
    report.main([*map(str, paths), "--merged", str(tmp_path / "m.json"), "--png", str(tmp_path / "m.png"),
                 "--markdown", str(tmp_path / "m.md")])  # fmt: skip
    assert (tmp_path / "m.png").stat().st_size > 1000
    assert json.loads((tmp_path / "m.json").read_text())["summary"]["float16/batch_last"]["rows"] == 4
    assert "MEASURED_VARIANTS" in (tmp_path / "m.md").read_text()


def test_pick_variant_follows_the_measured_table_and_falls_back(monkeypatch):
    shipped = ks.MEASURED_VARIANTS
    assert all(tile in ks.TILE_ROWS and isinstance(pipe, bool) for tile, pipe in shipped.values())
    for key, variant in shipped.items():  # the shipped table is what pick_variant returns for its keys
        layout, b_cls, c_cls, d_cls = key
        b = {"b%128": 256, "b<=64": 48, "b>64": 192}[b_cls]
        c = {"c<=64": 48, "c<=256": 192, "c>256": 512}[c_cls]
        d = 1 if d_cls == "d=1" else 4
        assert ks.variant_key(b, c, d, layout == "batch_first") == key
        assert ks.pick_variant(b, c, d, torch.float16, layout == "batch_first") == variant
    monkeypatch.setattr(ks, "MEASURED_VARIANTS", {})
    assert ks.pick_variant(192, 192, 1, torch.float16) == (ks.pick_tile(192, 192, torch.float16), ks.PIPELINED_DEFAULT)
    assert ks.pick_variant(256, 256, 4, torch.float32, True) == (128, False)
    monkeypatch.setattr(ks, "MEASURED_VARIANTS", {ks.variant_key(192, 192, 1, True): (128, True)})
    assert ks.pick_variant(192, 192, 1, torch.bfloat16, batch_first=True) == (128, True)
    assert ks.pick_variant(192, 192, 1, torch.float16, batch_first=False) == (64, ks.PIPELINED_DEFAULT)
    assert ks.variant_key(256, 48, 2, True) == ("batch_first", "b%128", "c<=64", "d>1")
