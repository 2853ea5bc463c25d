"""The custom Kedro datasets: Parquet round trip, tolerated absence, JSON lines."""

from __future__ import annotations

import pyarrow as pa
import pytest
from kedro.io import DataCatalog
from kedro.io.core import DatasetError

from lychee_pipeline.datasets import ArrowTableDataset, JSONLinesDataset
from lychee_pipeline.schema import MODEL_INPUT_SCHEMA


def test_arrow_round_trip_keeps_schema(tmp_path):
    table = pa.Table.from_pylist(
        [{"record_id": "r1", "query": {"text": "q", "image": None},
          "positives": [{"doc_id": "d", "text": "t", "image": None, "meta": "{}"}],
          "negatives": [], "task_type": "t2t", "language": "en", "split": None}],
        schema=MODEL_INPUT_SCHEMA)
    dataset = ArrowTableDataset(str(tmp_path / "x" / "t.parquet"))
    assert not dataset.exists()
    dataset.save(table)
    loaded = dataset.load()
    assert loaded.equals(table) and loaded.schema.equals(MODEL_INPUT_SCHEMA)
    assert list((tmp_path / "x").iterdir()) == [tmp_path / "x" / "t.parquet"]


def test_arrow_missing(tmp_path):
    assert ArrowTableDataset(str(tmp_path / "none.parquet"), missing_ok=True).load() is None
    with pytest.raises(DatasetError):
        ArrowTableDataset(str(tmp_path / "none.parquet")).load()
    with pytest.raises(DatasetError):
        ArrowTableDataset(str(tmp_path / "a.parquet")).save([{"a": 1}])


def test_json_lines_round_trip_from_catalog_config(tmp_path):
    catalog = DataCatalog.from_config({
        "rejected": {"type": "lychee_pipeline.datasets.JSONLinesDataset", "filepath": str(tmp_path / "r.jsonl")},
        "table": {"type": "lychee_pipeline.datasets.ArrowTableDataset", "filepath": str(tmp_path / "t.parquet"),
                  "missing_ok": True},
    })
    rows = [{"file": "a.jsonl", "line": 3, "reason": "empty query", "raw": "{\"query\": \"红\"}"}]
    catalog.save("rejected", rows)
    assert catalog.load("rejected") == rows
    assert "红" in (tmp_path / "r.jsonl").read_text(encoding="utf-8")
    assert catalog.load("table") is None
    assert JSONLinesDataset(str(tmp_path / "r.jsonl")).load() == rows
