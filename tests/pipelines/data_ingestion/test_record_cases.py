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
    assert quarantined.to_pylist()[0]["reason"] == "fewer than min_negatives: 0 < 1"
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
