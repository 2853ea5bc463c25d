"""The data pipelines run end to end with SequentialRunner on an in-memory catalog."""

from __future__ import annotations

import logging
import re

import pyarrow.parquet as pq
from kedro.io import DataCatalog, MemoryDataset
from kedro.runner import SequentialRunner

from lychee_pipeline.datasets import ArrowTableDataset
from lychee_pipeline.pipelines import data_ingestion, data_split, demo_data, image_normalization
from lychee_pipeline.schema import MODEL_INPUT_SCHEMA

DATA = {"raw_path": None, "image_roots": []}
PROCESSING = {"ingestion": {"batch_size": 1000},
              "image_check": {"workers": 1, "max_pixels": 1_000_000},
              "normalization": {"policy": "quarantine", "min_negatives": 1},
              "split": {"seed": 42, "ratios": {"train": 0.8, "val": 0.1, "test": 0.1}}}


def _catalog(data: dict, demo: dict, previous_manifest_path: str, sample_size: int = 5000) -> DataCatalog:
    datasets = {"params:data": data, "params:demo_data": demo, "params:smoke.sample_size": sample_size,
                **{f"params:data_processing.{k}": v for k, v in PROCESSING.items()}}
    catalog = DataCatalog({k: MemoryDataset(v) for k, v in datasets.items()})
    catalog["previous_image_manifest"] = ArrowTableDataset(previous_manifest_path, missing_ok=True)
    return catalog


def _data_pipeline():
    return data_ingestion.create_pipeline() + image_normalization.create_pipeline() + data_split.create_pipeline()


def test_bad_corpus_through_all_data_pipelines(data_bad_corpus, tmp_path, caplog):
    data = {**DATA, "raw_path": str(data_bad_corpus["jsonl"]), "image_roots": [str(data_bad_corpus["root"])]}
    catalog = _catalog(data, {}, str(tmp_path / "manifest.parquet"))
    with caplog.at_level(logging.INFO):
        SequentialRunner().run(_data_pipeline(), catalog)
    counts = catalog.load("data_counts")
    # every quarantined record (up to 5) gets a log line with its reason, as rejected lines do
    quarantined = catalog.load("quarantined_records").to_pylist()
    for row in quarantined[:5]:
        assert f"quarantined {row['record_id']}: {row['reason']}" in caplog.text
    # the image check says which references it could not resolve, by reason (not "0 bad" alone): the corpus's
    # img-missing and query-missing; img-traversal, img-symlink and img-outside (tests/conftest.py)
    assert re.search(r"image manifest: \d+ images, \d+ bad; references not resolved: \{'image not found': 2, "
                     r"'path escapes the image roots': 3\}", caplog.text)
    assert counts["lines_in"] == counts["clean"] + counts["rejected"] + counts["duplicates"]
    assert counts["rejected"] == len(data_bad_corpus["rejected"])
    assert counts["quarantined"] == len(data_bad_corpus["quarantined"]) and counts["negatives_removed"] == 2
    assert counts["train_size"] + counts["val_size"] + counts["test_size"] == counts["clean"] - counts["quarantined"]
    assert counts["train_size"] == counts["smoke_size"]
    assert {r["line"] for r in catalog.load("rejected_lines")} == set(data_bad_corpus["rejected"])
    # duplicates are listed, not only counted: line 9 repeats line 1, line 11 (NFD text) repeats line 10
    duplicates = catalog.load("duplicate_lines")
    assert [(d["line"], d["first_line"]) for d in duplicates] == [(9, 1), (11, 10)]
    assert len(duplicates) == counts["duplicates"] == data_bad_corpus["duplicates"]


def test_demo_data_through_all_data_pipelines(tmp_path):
    demo = {"out_dir": str(tmp_path / "data" / "01_raw" / "demo"), "seed": 3, "n_products": 60, "n_records": 300}
    catalog = _catalog(DATA, demo, str(tmp_path / "manifest.parquet"), sample_size=100)
    path = tmp_path / "train.parquet"
    catalog["train_records"] = ArrowTableDataset(str(path))
    SequentialRunner().run(demo_data.create_pipeline() + _data_pipeline(), catalog)
    counts = catalog.load("data_counts")
    assert counts["rejected"] == 0 and counts["quarantined"] == 0 and counts["negatives_removed"] == 0
    assert counts["images_bad"] == 0 and counts["images_checked"] == 60
    assert counts["smoke_size"] == 100 and catalog.load("demo_data_summary")["generated"] is True
    train = catalog.load("train_records")
    assert train.schema.equals(MODEL_INPUT_SCHEMA)
    assert pq.read_schema(path).equals(MODEL_INPUT_SCHEMA)
    assert {"t2it", "i2it"} <= set(train.column("task_type").to_pylist())
    assert {"en", "zh", "und"} <= set(train.column("language").to_pylist())


def test_pipelines_have_the_agreed_names():
    names = {n.name for n in (demo_data.create_pipeline() + _data_pipeline()).nodes}
    assert names == {"generate_demo_data", "locate_raw_data", "parse_validate_dedup_records", "check_unique_images",
                     "resolve_and_quarantine_records", "split_by_query_group", "sample_smoke_subset",
                     "collect_data_counts"}
