"""Records that must not pass as they are: invisible-only text, non-finite meta, false and repeated negatives."""

from __future__ import annotations

import json
from pathlib import Path

from lychee_pipeline.pipelines.data_ingestion.nodes import ingest_records
from lychee_pipeline.pipelines.image_normalization.nodes import normalize_records
from lychee_pipeline.schema import MANIFEST_SCHEMA

ZW = "\u200b\u200c\u2060\ufeff"


def _write(path: Path, lines: list[str]) -> dict:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return {"files": [str(path)], "image_roots": [str(path.parent)], "demo": False}


def test_zero_width_text_and_non_finite_meta_are_refused(tmp_path):
    ok = {"query": "q", "pos_doc": {"text": "d"}}
    lines = [
        json.dumps({**ok, "query": ZW}),                                               # 1 empty query
        json.dumps({**ok, "query": {"text": " \u200b ", "image": None}}),              # 2 empty query (object)
        json.dumps({**ok, "pos_doc": {"text": "\u2060\ufeff"}}),                       # 3 empty document
        json.dumps({**ok, "neg_docs": [{"text": "\u200c"}]}),                          # 4 empty document
        '{"query": "q", "pos_doc": {"text": "d", "meta": {"pop": NaN}}}',             # 5 NaN
        '{"query": "q", "pos_doc": {"text": "d", "meta": {"pop": Infinity}}}',        # 6 Infinity
        '{"query": "q", "pos_doc": {"text": "d"}, "neg_docs": [{"text": "n", "meta": {"x": [1, -Infinity]}}]}',  # 7
        '{"query": "q", "pos_docs": [{"text": "d", "meta": {"pop": 1e999}}]}',        # 8 1e999
        json.dumps({**ok, "query": "\u200bred dress\ufeff", "pos_doc": {"text": "d", "meta": {"pop": 1e300}}}),  # 9
    ]
    table, rejected, counts = ingest_records(_write(tmp_path / "a.jsonl", lines), {})
    reasons = {r["line"]: r["reason"] for r in rejected}
    assert counts["lines_in"] == len(lines) == counts["clean"] + counts["rejected"] + counts["duplicates"]
    assert set(reasons) == set(range(1, 9)) and counts["clean"] == 1
    assert reasons[1] == reasons[2] == "empty query"
    assert reasons[3].startswith("empty document (positive 0") and reasons[4].startswith("empty document (negative 0")
    for line, loc in ((5, "pos_doc.meta.pop"), (6, "pos_doc.meta.pop"), (7, "neg_docs.0.meta.x.1"),
                      (8, "pos_docs.0.meta.pop")):
        assert reasons[line].startswith("non-finite number") and f"'{loc}'" in reasons[line], reasons[line]
    row = table.to_pylist()[0]
    assert row["query"]["text"] == "red dress" and json.loads(row["positives"][0]["meta"]) == {"pop": 1e300}


def test_false_and_repeated_negatives_are_removed_with_a_reason(tmp_path):
    pos = {"id": "sku-1", "text": "red dress"}
    lines = [
        json.dumps({"id": "r1", "query": "a", "pos_doc": pos,
                    "neg_docs": [{"id": "sku-1", "text": "other text, same id"}, {"text": "red dress"},
                                 {"id": "n1", "text": "suit"}, {"id": "n1", "text": "suit"}, {"text": "hat"},
                                 {"text": "hat", "hard": False}]}),
        json.dumps({"id": "r2", "query": "b", "pos_doc": pos, "neg_docs": [{"id": "sku-1", "text": "red dress"}]}),
    ]
    table, rejected, counts = ingest_records(_write(tmp_path / "a.jsonl", lines), {})
    assert rejected == [] and counts["clean"] == 2
    normalized, quarantined, removed, ncounts = normalize_records(
        table, MANIFEST_SCHEMA.empty_table(), {"image_roots": [str(tmp_path)]}, {"min_negatives": 1})
    assert ncounts["records_in"] == ncounts["normalized"] + ncounts["quarantined"]
    kept = {r["record_id"]: [d["text"] for d in r["negatives"]] for r in normalized.to_pylist()}
    assert kept == {"r1": ["suit", "hat"]}
    assert quarantined.to_pylist()[0]["reason"] == (  # its one negative was also a positive (sku-1)
        "fewer than data_processing.normalization.min_negatives: 0 < 1 (1 removed, each with its reason in "
        "removed_negatives)")
    reasons = [(r["record_id"], r["reason"]) for r in removed.to_pylist()]
    assert [r for r, _ in reasons] == ["r1"] * 4 + ["r2"]
    assert sum("also a positive (sku-1)" in why for _, why in reasons) == 3
    assert sum("duplicate negative" in why for _, why in reasons) == 2
    assert ncounts["negatives_removed"] == ncounts["negatives_collapsed"] == 5


def test_collapsing_is_not_an_image_failure_under_policy_fail(tmp_path):
    line = json.dumps({"query": "a", "pos_doc": {"text": "p"}, "neg_docs": [{"text": "n"}, {"text": "n"}]})
    table, _, _ = ingest_records(_write(tmp_path / "a.jsonl", [line]), {})
    normalized, _, removed, _ = normalize_records(
        table, MANIFEST_SCHEMA.empty_table(), {"image_roots": [str(tmp_path)]}, {"policy": "fail"})
    assert normalized.num_rows == 1 and removed.num_rows == 1


def test_text_longer_than_max_text_chars_is_rejected_never_cut(tmp_path):
    long_text = "长" * 60  # 60 characters (180 UTF-8 bytes): the limit counts characters
    lines = [
        json.dumps({"query": "q", "pos_doc": {"text": "x" * 50}}),                         # 1 at the limit: kept
        json.dumps({"query": "q", "pos_doc": {"text": long_text}}),                        # 2 positive too long
        json.dumps({"query": "q", "pos_docs": [{"text": "d"}, {"text": "y" * 51}]}),       # 3 second positive
        json.dumps({"query": "q", "pos_doc": {"text": "d"}, "neg_docs": [{"text": "n"}, {"text": "z" * 99}]}),  # 4
        json.dumps({"query": {"text": "w" * 70, "image": "a.png"}, "pos_doc": {"text": "d"}}),  # 5 query
        json.dumps({"query": "q2", "pos_doc": {"text": "  " + "v" * 50 + "\u200b "}}),      # 6 50 once stripped
    ]
    source = _write(tmp_path / "a.jsonl", lines)
    for options in ({"max_text_chars": 50}, {"max_text_chars": 50, "workers": 2, "chunk_mb": 0.0001}):
        table, rejected, counts = ingest_records(source, options)
        assert counts["lines_in"] == len(lines) == counts["clean"] + counts["rejected"] + counts["duplicates"]
        reasons = {r["line"]: r["reason"] for r in rejected}
        assert set(reasons) == {2, 3, 4, 5} and counts["clean"] == 2, reasons
        for line, n, loc in ((2, 60, "pos_doc.text"), (3, 51, "pos_docs.1.text"), (4, 99, "neg_docs.1.text"),
                             (5, 70, "query")):
            assert reasons[line] == (f"text too long: {n} characters at '{loc}' > data_processing.ingestion."
                                     "max_text_chars=50 (never truncated: shorten it or raise the limit)")
        assert all(r["raw"] == lines[r["line"] - 1] for r in rejected)  # the whole line is kept for review
        assert [len(r["positives"][0]["text"]) for r in table.to_pylist()] == [50, 50]  # nothing cut
    table, rejected, _ = ingest_records(source, {"max_text_chars": 100})
    assert table.num_rows == 6 and rejected == []
    assert len(ingest_records(source, {})[0]) == 6  # default 20000


def test_duplicate_lines_are_listed_with_their_first_occurrence(tmp_path):
    from lychee_pipeline.pipelines.data_ingestion.nodes import ingest_files

    a = {"query": "red dress", "pos_doc": {"text": "a red dress"}}
    b = {"query": "blue shirt", "pos_doc": {"text": "a blue shirt"}}
    first = tmp_path / "a.jsonl"
    first.write_text("\n".join([json.dumps(a), json.dumps(b), json.dumps(a)]) + "\n", encoding="utf-8")
    second = tmp_path / "b.jsonl"
    second.write_text("\n".join([json.dumps({**b, "query": " blue shirt\u200b"}), json.dumps({"id": "x", **a})])
                      + "\n", encoding="utf-8")
    source = {"files": [str(first), str(second)], "image_roots": [str(tmp_path)], "demo": False}
    table, rejected, counts, raw_files, duplicates = ingest_files(source, {"workers": 1})
    assert counts == {"lines_in": 5, "clean": 2, "rejected": 0, "duplicates": 3}
    ids = table.column("record_id").to_pylist()
    assert duplicates == [
        {"file": str(first), "line": 3, "id": None, "first_file": str(first), "first_line": 1,
         "first_record_id": ids[0]},
        {"file": str(second), "line": 1, "id": None, "first_file": str(first), "first_line": 2,
         "first_record_id": ids[1]},
        {"file": str(second), "line": 2, "id": "x", "first_file": str(first), "first_line": 1,  # ids aside
         "first_record_id": ids[0]},
    ]
    assert [f["duplicates"] for f in raw_files["files"]] == [1, 2]
