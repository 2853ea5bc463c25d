"""Query-grouped split, smoke subset and counts."""

from __future__ import annotations

import logging

import pyarrow as pa
import pytest

from lychee_pipeline.data.split import query_keys
from lychee_pipeline.pipelines.data_split.nodes import collect_data_counts, make_smoke_subset, split_records
from lychee_pipeline.schema import MODEL_INPUT_SCHEMA

SPLIT = {"seed": 7, "ratios": {"train": 0.8, "val": 0.1, "test": 0.1}}


def _table(n_queries: int, per_query: int, pins: dict[int, str] | None = None) -> pa.Table:
    rows = []
    for q in range(n_queries):
        for k in range(per_query):
            i = q * per_query + k
            rows.append({"record_id": f"r{i}", "query": {"text": f"query {q}", "image": None},
                         "positives": [{"doc_id": f"d{i}", "text": "t", "image": None, "meta": "{}"}],
                         "negatives": [], "task_type": "t2t", "language": "en", "split": (pins or {}).get(i)})
    return pa.Table.from_pylist(rows, schema=MODEL_INPUT_SCHEMA)


def test_a_query_never_crosses_splits_and_ratios_hold():
    table = _table(200, 3)
    train, val, test, counts = split_records(table, {**SPLIT, "method": "ordered"})  # exact ratios
    groups = [set(query_keys(part)) for part in (train, val, test)]
    assert not (groups[0] & groups[1] or groups[0] & groups[2] or groups[1] & groups[2])
    assert (counts["train_queries"], counts["val_queries"], counts["test_queries"]) == (160, 20, 20)
    assert train.num_rows + val.num_rows + test.num_rows == table.num_rows
    for part, name in ((train, "train"), (val, "val"), (test, "test")):
        assert part.schema.equals(MODEL_INPUT_SCHEMA) and set(part.column("split").to_pylist()) == {name}


def test_split_is_deterministic_by_seed():
    table = _table(100, 2)
    a = split_records(table, SPLIT)
    b = split_records(table, SPLIT)
    c = split_records(table, {**SPLIT, "seed": 8})
    assert all(x.equals(y) for x, y in zip(a[:3], b[:3]))
    assert not a[1].equals(c[1])


def test_pinned_split_is_honoured_for_the_whole_query(caplog):
    table = _table(50, 2, pins={0: "test", 3: "val", 5: "train", 4: "test"})  # r4 conflicts with r5 (same query)
    with caplog.at_level(logging.WARNING):
        train, val, test, _ = split_records(table, SPLIT)
    ids = {name: set(p.column("record_id").to_pylist()) for name, p in zip(("train", "val", "test"), (train, val, test))}
    assert {"r0", "r1"} <= ids["test"] and {"r2", "r3"} <= ids["val"] and {"r4", "r5"} <= ids["test"]
    assert "pin a query to another split" in caplog.text


def test_bad_ratios_are_refused():
    with pytest.raises(ValueError, match="sum to 1"):
        split_records(_table(3, 1), {"seed": 0, "ratios": {"train": 0.9, "val": 0.2, "test": 0.1}})


def test_smoke_subset_is_deterministic_and_sized(caplog):
    train = _table(300, 1)
    a = make_smoke_subset(train, 50, SPLIT)
    assert a.num_rows == 50 and a.equals(make_smoke_subset(train, 50, SPLIT))
    assert set(a.column("record_id").to_pylist()) <= set(train.column("record_id").to_pylist())
    assert not a.equals(make_smoke_subset(train, 50, {**SPLIT, "seed": 1}))
    with caplog.at_level(logging.INFO):
        everything = make_smoke_subset(train, 5000, SPLIT)
    assert everything.num_rows == 300 and "all 300 training records" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # expected with small data: no warning


def test_collect_data_counts():
    counts = collect_data_counts({"lines_in": 3, "clean": 2, "rejected": 1, "duplicates": 0},
                                 {"quarantined": 1, "negatives_removed": 2}, {"train_size": 1}, _table(1, 1))
    assert counts == {"lines_in": 3, "clean": 2, "rejected": 1, "duplicates": 0, "quarantined": 1,
                      "negatives_removed": 2, "train_size": 1, "smoke_size": 1}


def test_hash_split_never_moves_a_query_when_records_are_added_or_removed():
    before = _table(300, 2)
    grown = pa.concat_tables([before, _table(800, 2).slice(600)])  # 500 more queries
    shrunk = before.slice(0, 200)
    def where(table):
        parts = split_records(table, SPLIT)[:3]
        return {rid: name for name, part in zip(("train", "val", "test"), parts)
                for rid in part.column("record_id").to_pylist()}
    first, second, third = where(before), where(grown), where(shrunk)
    assert all(second[rid] == name for rid, name in first.items())
    assert all(first[rid] == name for rid, name in third.items())
    counts = split_records(grown, SPLIT)[3]
    assert abs(counts["train_ratio"] - 0.8) < 0.05 and abs(counts["val_ratio"] - 0.1) < 0.03
    assert counts["train_queries"] + counts["val_queries"] + counts["test_queries"] == 800
    assert not split_records(before, {**SPLIT, "seed": 8})[1].equals(split_records(before, SPLIT)[1])


def test_hash_split_keeps_pins_and_groups():
    table = _table(50, 2, pins={0: "test", 3: "val"})
    train, val, test, _ = split_records(table, SPLIT)
    ids = {name: set(p.column("record_id").to_pylist()) for name, p in zip(("train", "val", "test"), (train, val, test))}
    assert {"r0", "r1"} <= ids["test"] and {"r2", "r3"} <= ids["val"]
    groups = [set(query_keys(part)) for part in (train, val, test)]
    assert not (groups[0] & groups[1] or groups[0] & groups[2] or groups[1] & groups[2])


def test_unknown_split_method_is_refused():
    with pytest.raises(ValueError, match="split.method"):
        split_records(_table(3, 1), {**SPLIT, "method": "random"})


def test_nothing_to_split_is_a_warning_naming_where_the_reasons_are(caplog):
    with caplog.at_level(logging.WARNING):
        train, val, test, counts = split_records(_table(0, 1), SPLIT)
    assert train.num_rows == val.num_rows == test.num_rows == counts["train_size"] == 0
    assert "no records to split" in caplog.text and "quarantined_records" in caplog.text
