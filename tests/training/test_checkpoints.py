"""Checkpoints: published atomically, verified by checksum, the newest intact one resumed."""

from pathlib import Path

from lychee_pipeline.training import checkpoints


def _write(root: Path, step: int, payload: bytes = b"weights") -> Path:
    tmp = checkpoints.staging_dir(root, step)
    tmp.mkdir(parents=True)
    (tmp / "model.safetensors").write_bytes(payload * 100)
    (tmp / "random_states_0.pkl").write_bytes(b"rng")
    return checkpoints.publish(root, step, {"step": step, "losses": [[step, 0.5]]})


def test_newest_intact_checkpoint_is_resumed(tmp_path):
    _write(tmp_path, 10)
    _write(tmp_path, 20)
    found, state, skipped = checkpoints.find_resumable(tmp_path)
    assert found.name == "checkpoint-20" and state["step"] == 20 and skipped == []


def test_half_written_checkpoint_is_never_taken(tmp_path):
    _write(tmp_path, 10)
    partial = checkpoints.staging_dir(tmp_path, 20)  # the writer died before publishing
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    found, state, _ = checkpoints.find_resumable(tmp_path)
    assert found.name == "checkpoint-10" and state["step"] == 10


def test_checkpoint_without_manifest_is_skipped_with_reason(tmp_path):
    _write(tmp_path, 10)
    broken = tmp_path / "checkpoint-30"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"x")
    found, _, skipped = checkpoints.find_resumable(tmp_path)
    assert found.name == "checkpoint-10"
    assert skipped == ["checkpoint-30: no manifest (write interrupted)"]


def test_corrupted_checkpoint_detected_and_previous_used(tmp_path):
    _write(tmp_path, 10)
    newest = _write(tmp_path, 20)
    weights = newest / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[5] ^= 0xFF  # flip bits in place, same size
    weights.write_bytes(bytes(data))
    found, _, skipped = checkpoints.find_resumable(tmp_path)
    assert found.name == "checkpoint-10"
    assert skipped == ["checkpoint-20: checksum mismatch in model.safetensors"]


def test_prune_keeps_last_k(tmp_path):
    for step in (10, 20, 30):
        _write(tmp_path, step)
    checkpoints.prune(tmp_path, keep_last=2)
    assert [p.name for p in checkpoints.list_checkpoints(tmp_path)] == ["checkpoint-30", "checkpoint-20"]


def test_resume_says_whether_there_is_a_checkpoint_before_the_stage_launches(tmp_path, monkeypatch, caplog):
    """`training.resume=true` with nothing to resume from said only "no result.json" and trained from step 0;
    the log now names the folder it looked in, or the checkpoint it resumes from. (The launch itself is not
    what is checked here: it is stopped where it would start.)"""
    import pytest
    from stage_plans import worker_plan

    from lychee_pipeline.training import planning
    from lychee_pipeline.training.planning import run_training_stage

    def launch(*args, **kwargs):
        raise RuntimeError("launch")

    monkeypatch.setattr(planning, "run_stage", launch)
    plan = worker_plan(tmp_path, resume=True, max_steps=8, checkpoint_every=4)
    stage = Path(plan.run_dir) / "stage_1cpu_final"
    table = tmp_path / "train.parquet"
    table.write_bytes(b"rows")  # hashed into the spec, never read: nothing launches
    with caplog.at_level("INFO", logger="lychee_pipeline.training.planning"), pytest.raises(RuntimeError):
        run_training_stage(str(table), plan, devices=1, final=True)
    assert (f"stage_1cpu_final: training.resume: no checkpoint found under {stage / 'checkpoints'}, starting "
            "from step 0") in caplog.text
    caplog.clear()
    _write(stage / "checkpoints", 4)
    with caplog.at_level("INFO", logger="lychee_pipeline.training.planning"), pytest.raises(RuntimeError):
        run_training_stage(str(table), plan, devices=1, final=True)
    assert "training.resume: resuming from the newest intact of 1 checkpoint(s)" in caplog.text
    assert "(newest checkpoint-4)" in caplog.text
