"""The stdlib docstring corpus and user text files."""

from __future__ import annotations

import pytest

from prunekit.data import DataError, calibration_texts, evaluation_texts, load_texts, stdlib_corpus


def test_corpus_is_real_prose_split_without_overlap():
    calibration, held_out = stdlib_corpus()
    assert len(calibration) > 500 and len(held_out) > 100
    assert not set(calibration) & set(held_out)
    assert all(60 <= len(t) <= 1000 and ">>>" not in t for t in calibration + held_out)
    assert calibration_texts(5) == list(calibration[:5]) and evaluation_texts(3) == list(held_out[:3])


def test_corpus_is_deterministic():
    stdlib_corpus.cache_clear()
    first = stdlib_corpus()
    stdlib_corpus.cache_clear()
    assert stdlib_corpus() == first


def test_load_texts_reads_lines_and_jsonl(tmp_path):
    lines = tmp_path / "a.txt"
    lines.write_text("one\n\n  two  \nthree\n")
    assert load_texts(lines) == ["one", "two", "three"]
    assert load_texts(lines, limit=2) == ["one", "two"]
    jsonl = tmp_path / "b.data"
    jsonl.write_text('{"text": "x y"}\n{"text": "z", "id": 2}\n')
    assert load_texts(jsonl) == ["x y", "z"]


@pytest.mark.parametrize(
    "name,content,match",
    [
        ("empty.txt", "\n\n", "no text"),
        ("bad.jsonl", '{"text": "a"}\n{oops\n', "bad.jsonl:2: not valid JSON"),
        ("field.jsonl", '{"text": 3}\n', "field.jsonl:1: expected an object"),
    ],
)
def test_load_texts_errors_name_the_file_and_line(tmp_path, name, content, match):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError, match=match):
        load_texts(path)
    with pytest.raises(DataError, match="not found"):
        load_texts(tmp_path / "missing.txt")


def test_corpus_does_not_depend_on_what_the_process_imported(monkeypatch):
    """torch.package replaces inspect.getfile when imported; the harvest runs in a fresh interpreter, so a patched
    stdlib function in this process changes nothing."""
    import inspect

    from prunekit.data import corpus

    before = corpus.stdlib_corpus()

    def _patched_getfile(obj):
        return "patched"

    monkeypatch.setattr(inspect, "getfile", _patched_getfile)
    corpus.stdlib_corpus.cache_clear()
    try:
        after = corpus.stdlib_corpus()
    finally:
        corpus.stdlib_corpus.cache_clear()
    assert after == before
    assert any(t.startswith("Work out which source or compiled file") for t in before[0] + before[1])
