"""Ingestion nodes on the bad-input corpus: every line lands where it should, with its reason."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from lychee_pipeline.pipelines.data_ingestion.nodes import ingest_records, locate_raw_data
from lychee_pipeline.data.records import detect_language, jsonl_files, norm_text
from lychee_pipeline.schema import MODEL_INPUT_SCHEMA


def test_every_bad_line_is_rejected_with_its_reason(data_bad_corpus):
    table, rejected, counts = ingest_records(data_bad_corpus["source"], {"batch_size": 4})
    got = {row["line"]: row["reason"] for row in rejected}
    assert set(got) == set(data_bad_corpus["rejected"])
    for line, expected in data_bad_corpus["rejected"].items():
        assert expected in got[line], (line, got[line])
    assert all(row["file"] == str(data_bad_corpus["jsonl"]) and row["raw"] is not None for row in rejected)


def test_count_invariant_and_duplicates(data_bad_corpus):
    table, rejected, counts = ingest_records(data_bad_corpus["source"], {})
    assert counts["lines_in"] == data_bad_corpus["lines_in"]
    assert counts["duplicates"] == data_bad_corpus["duplicates"]
    assert counts["rejected"] == len(data_bad_corpus["rejected"])
    assert counts["lines_in"] == counts["clean"] + counts["rejected"] + counts["duplicates"]
    assert table.num_rows == counts["clean"]
    assert table.schema.equals(MODEL_INPUT_SCHEMA)
    assert len(set(table.column("record_id").to_pylist())) == table.num_rows


def test_worker_pool_over_small_chunks_gives_the_same_result(data_bad_corpus):
    serial = ingest_records(data_bad_corpus["source"], {"workers": 1})
    pooled = ingest_records(data_bad_corpus["source"], {"workers": 2, "chunk_mb": 0.0005})  # ~500-byte ranges
    assert pooled[0].equals(serial[0]) and pooled[1] == serial[1] and pooled[2] == serial[2]


def test_text_is_nfc_stripped_and_bom_crlf_free(data_bad_corpus):
    table, _, _ = ingest_records(data_bad_corpus["source"], {})
    rows = table.to_pylist()
    first = rows[0]
    assert first["query"] == {"text": "红色连衣裙适合什么场合 👗", "image": None}
    assert first["language"] == "zh" and first["task_type"] == "t2it"
    assert first["negatives"][0]["hard"] is True and first["negatives"][0]["meta"] == "{}"
    cafe = [r for r in rows if r["query"]["text"] and r["query"]["text"].startswith("caf")]
    assert len(cafe) == 1 and cafe[0]["query"]["text"] == "caf\u00e9 cr\u00e8me"
    by_id = {r["record_id"]: r for r in rows}
    assert by_id["image-query"]["task_type"] == "it2it"
    assert by_id["query-missing"]["task_type"] == "i2it" and by_id["query-missing"]["language"] == "und"
    assert by_id["same"]["query"]["text"] == "q1"


def test_ids_are_stable_content_hashes(tmp_path):
    record = {"query": "blue shirt", "pos_doc": {"text": "a blue shirt", "meta": {"clicks": 3, "category": "shirt"}},
              "neg_docs": [{"text": "a red shirt", "hard": False}]}
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(record) + "\n" + json.dumps({**record, "query": "red shirt"}) + "\n")
    source = {"files": [str(path)], "image_roots": [str(tmp_path)]}
    first, _, _ = ingest_records(source, {})
    second, _, _ = ingest_records(source, {})
    assert first.equals(second)
    rows = first.to_pylist()
    assert rows[0]["record_id"].startswith("r") and rows[0]["record_id"] != rows[1]["record_id"]
    assert rows[0]["positives"][0]["doc_id"] == rows[1]["positives"][0]["doc_id"]
    assert json.loads(rows[0]["positives"][0]["meta"]) == {"category": "shirt", "clicks": 3}
    assert rows[0]["negatives"][0]["hard"] is False


def test_pos_docs_list_and_pinned_split(tmp_path):
    record = {"id": "r1", "query": {"text": "q"}, "pos_doc": {"id": "a", "text": "x"},
              "pos_docs": [{"id": "b", "image": "b.png"}], "split": "test"}
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(record) + "\n" + json.dumps({**record, "id": "r2", "split": "holdout"}) + "\n")
    table, rejected, _ = ingest_records({"files": [str(path)], "image_roots": [str(tmp_path)]}, {})
    row = table.to_pylist()[0]
    assert [d["doc_id"] for d in row["positives"]] == ["a", "b"] and row["split"] == "test"
    assert row["negatives"] == [] and row["task_type"] == "t2t"
    assert len(rejected) == 1 and "wrong type at 'split'" in rejected[0]["reason"]


@pytest.mark.parametrize(
    ("text", "language"),
    [("red dress", "en"), ("红色连衣裙", "zh"), ("赤いドレス", "ja"), ("빨간 드레스", "ko"), ("красное платье", "ru"),
     ("فستان أحمر", "ar"), ("12345 !!", "und"), (None, "und"), ("café", "en"), ("👗 dress", "en")],
)
def test_detect_language(text, language):
    assert detect_language(text) == language


def test_norm_text():
    assert norm_text("  e\u0301  ") == "\u00e9"
    assert norm_text("   ") is None and norm_text(None) is None


def test_locate_raw_data_user_folder_and_glob(tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ("b.jsonl", "a.jsonl", "sub/c.jsonl", "notes.txt"):
        (tmp_path / name).write_text("")
    source = locate_raw_data({"raw_path": str(tmp_path), "image_roots": [str(tmp_path / "sub")]}, {})
    assert source["files"] == [str(tmp_path / n) for n in ("a.jsonl", "b.jsonl", "sub/c.jsonl")]
    assert source["image_roots"] == [str((tmp_path / "sub").resolve())] and source["demo"] is False
    assert jsonl_files(str(tmp_path / "*.jsonl")) == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    defaulted = locate_raw_data({"raw_path": str(tmp_path / "a.jsonl")}, {})
    assert defaulted["image_roots"] == [str(tmp_path.resolve())]
    with pytest.raises(FileNotFoundError):
        locate_raw_data({"raw_path": str(tmp_path / "none" / "*.jsonl")}, {})


def test_locate_raw_data_uses_demo_when_no_raw_path(tmp_path):
    out = tmp_path / "data" / "01_raw" / "demo"
    source = locate_raw_data({"raw_path": None}, {"out_dir": str(out), "n_products": 20, "n_records": 30})
    assert source["demo"] is True and source["image_roots"] == [str(out.resolve())]
    table, rejected, counts = ingest_records(source, {})
    assert rejected == [] and counts["lines_in"] == 30 and table.num_rows + counts["duplicates"] == 30
    assert isinstance(table, pa.Table)
