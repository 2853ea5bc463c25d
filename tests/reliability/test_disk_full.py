"""Disk full (an injected OSError(ENOSPC) after half a file was written): a clear error, earlier outputs intact."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pyarrow as pa
import pytest
from kedro.io.core import DatasetError

from lychee_pipeline import datasets
from lychee_pipeline.training import checkpoints

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _half_then_enospc(original):
    """A writer that writes part of its output, then fails as a full disk does."""

    def write(data, where, *args, **kwargs):
        Path(where).write_bytes(b"PAR1 half a file")
        raise ENOSPC

    return write


def test_arrow_dataset_save_disk_full_keeps_previous_file(tmp_path, monkeypatch):
    target = tmp_path / "02_intermediate" / "records.parquet"
    dataset = datasets.ArrowTableDataset(str(target))
    before = pa.table({"x": [1, 2, 3]})
    dataset.save(before)
    monkeypatch.setattr(datasets.pq, "write_table", _half_then_enospc(datasets.pq.write_table))
    with pytest.raises(DatasetError, match="No space left on device"):
        dataset.save(pa.table({"x": [4, 5]}))
    monkeypatch.undo()
    assert dataset.load().equals(before)
    assert sorted(p.name for p in target.parent.iterdir()) == ["records.parquet"]  # no half-written temp file


def test_json_lines_dataset_save_disk_full_keeps_previous_file(tmp_path, monkeypatch):
    target = tmp_path / "rejected.jsonl"
    dataset = datasets.JSONLinesDataset(str(target))
    dataset.save([{"line": 1, "reason": "empty line"}])
    calls = []
    real_dumps = datasets.json.dumps

    def dumps(obj, **kwargs):
        calls.append(obj)
        if len(calls) > 1:  # the second row hits the full disk
            raise ENOSPC
        return real_dumps(obj, **kwargs)

    monkeypatch.setattr(datasets.json, "dumps", dumps)
    with pytest.raises(DatasetError, match="No space left on device"):
        dataset.save([{"line": 1}, {"line": 2}])
    monkeypatch.undo()
    assert dataset.load() == [{"line": 1, "reason": "empty line"}]
    assert [p.name for p in tmp_path.iterdir()] == ["rejected.jsonl"]


def test_checkpoint_publish_disk_full_previous_checkpoint_resumed(tmp_path, monkeypatch):
    def write(step):
        staging = checkpoints.staging_dir(tmp_path, step)
        staging.mkdir(parents=True)
        (staging / "model.safetensors").write_bytes(b"w" * 1000)
        return staging

    write(10)
    checkpoints.publish(tmp_path, 10, {"step": 10, "losses": []})
    write(20)
    real_write_text = Path.write_text

    def full_disk(self, data, *args, **kwargs):
        if self.name == checkpoints.MANIFEST:
            real_write_text(self, data[: len(data) // 2])  # half a manifest, then the disk is full
            raise ENOSPC
        return real_write_text(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError, match="No space left on device"):
        checkpoints.publish(tmp_path, 20, {"step": 20, "losses": []})
    monkeypatch.undo()
    found, state, skipped = checkpoints.find_resumable(tmp_path)
    assert found.name == "checkpoint-10" and state["step"] == 10 and skipped == []
    checkpoints.prune(tmp_path, keep_last=2)  # the next successful checkpoint clears the staging folder
    assert not checkpoints.staging_dir(tmp_path, 20).exists()


def test_training_table_export_disk_full_keeps_previous_table(tmp_path, monkeypatch):
    from reliability_helpers import make_table, stage_plan

    from lychee_pipeline.pipelines.training import nodes
    from lychee_pipeline.training import planning

    plan = stage_plan(tmp_path)
    table = make_table(tmp_path)
    path = Path(nodes.export_training_table(table, plan))
    before = path.read_bytes()
    monkeypatch.setattr(planning.pq, "write_table", _half_then_enospc(planning.pq.write_table))
    with pytest.raises(OSError, match="No space left on device"):
        nodes.export_training_table(table.slice(0, 2), plan)
    assert path.read_bytes() == before and sorted(p.name for p in path.parent.iterdir()) == ["train.parquet"]
