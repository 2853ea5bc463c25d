"""Faults injected into real `accelerate launch` stages on CPU (builtin:tiny): each costs one or two launches.

* a crash in the middle of writing a checkpoint + a corrupted (bytes flipped) older checkpoint: the resumed
  run skips both, says so, and continues from the newest intact one with the same losses;
* one of two ranks killed: the survivor is stopped (no hang), StageFailed quotes both ranks' last lines;
* the MLflow store locked (sqlite busy): training finishes, files saved, the failure recorded and logged;
* a re-run reuses the finished stage (spec hash + adapter sha256 manifest), and relaunches when either changes.
"""

from __future__ import annotations

import logging
import shutil
import sqlite3
import time
from pathlib import Path

import pytest
from reliability_helpers import loss_lines, read_json, stage_plan
from stage_results import make_result

from lychee_pipeline.runtime.launcher import StageFailed
from lychee_pipeline.training import checkpoints, planning
from lychee_pipeline.training.planning import export_training_table, run_training_stage, stage_spec


def _flip_bytes(path: Path, at: int = 64) -> None:
    data = bytearray(path.read_bytes())
    for i in range(at, min(len(data), at + 8)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_one_rank_dies_the_other_is_stopped_and_both_are_quoted(tmp_path, reliability_table, no_fault_env):
    plan = stage_plan(tmp_path, gpus=2, max_steps=8, launch={"timeout_s": 240, "process_group_timeout_s": 20})
    no_fault_env.setenv("LYCHEE_FAULT", "after_step_2")
    no_fault_env.setenv("LYCHEE_FAULT_RANK", "1")
    started = time.monotonic()
    with pytest.raises(StageFailed) as failed:
        run_training_stage(reliability_table, plan, devices=2, final=True)
    elapsed = time.monotonic() - started
    message = str(failed.value)
    # torchrun's elastic agent notices the dead rank (monitor_interval 1 s) and stops the survivor: neither
    # the survivor's 20 s collective timeout nor the launcher's 240 s wall clock had to fire.
    assert "timed out" not in message and elapsed < 120, (elapsed, message)
    assert "rank 0:" in message and "rank 1:" in message
    rank0, rank1 = message.split("  rank 0:")[1].split("  rank 1:")
    # The survivor stopped at the step after which rank 1 was killed: it never finished a step alone. Its last
    # words are gloo reporting the lost peer, or its step 2 when torchrun's monitor stopped it first (a race
    # between two fast reactions that the launcher does not control).
    assert "[default0]" in rank0 and ("remote worker" in rank0 or "step 2/8" in rank0), rank0
    log_text = (Path(plan.run_dir) / "stage_2cpu_final" / "launch.log").read_text()
    assert "[rank 0] step 2/8" in log_text and "step 3/8" not in log_text
    assert "[rank 1] started" in rank1 and "(no output)" not in rank1
    assert "per-rank logs:" in message
    logging.getLogger(__name__).info("rank death detected in %.1f s", elapsed)


@pytest.fixture(scope="module")
def crashed_then_resumed(tmp_path_factory, reliability_table):
    """Two launches: a stage killed while writing checkpoint 3 (checkpoints 1 and 2 published), then, after
    flipping bytes in checkpoint-2, the resumed run, trained while the MLflow sqlite store is exclusively locked."""
    tmp = tmp_path_factory.mktemp("crash_resume")
    plan = stage_plan(tmp, max_steps=4, checkpoint_every=1)
    stage_dir = Path(plan.run_dir) / "stage_1cpu_final"
    root = stage_dir / "checkpoints"
    seen: dict = {"tmp": tmp, "stage_dir": stage_dir, "root": root}
    with pytest.MonkeyPatch.context() as mp:
        for name in ("LYCHEE_FAULT", "LYCHEE_FAULT_RANK", "MLFLOW_TRACKING_URI"):
            mp.delenv(name, raising=False)
        mp.setenv("LYCHEE_FAULT", "during_checkpoint_3")  # SIGKILL after save_state, before manifest + rename
        with pytest.raises(StageFailed, match="exited with code") as failed:
            run_training_stage(reliability_table, plan, devices=1, final=True)
        seen["failure"] = str(failed.value)
        seen["partial_exists"] = checkpoints.staging_dir(root, 3).is_dir()
        seen["published"] = [p.name for p in checkpoints.list_checkpoints(root)]
        seen["killed_losses"] = loss_lines((stage_dir / "launch.log").read_text())
        newest = root / "checkpoint-2"
        biggest = max((p for p in newest.rglob("*") if p.is_file() and p.name != checkpoints.MANIFEST),
                      key=lambda p: p.stat().st_size)
        _flip_bytes(biggest)
        seen["flipped"] = str(biggest.relative_to(newest))

        db = tmp / "mlflow.db"
        lock = sqlite3.connect(db, isolation_level=None)
        lock.execute("CREATE TABLE hold (x)")
        lock.execute("BEGIN EXCLUSIVE")  # every reader and writer now gets 'database is locked'
        lock.execute("INSERT INTO hold VALUES (1)")
        mp.delenv("LYCHEE_FAULT")
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
        seen["plan"] = stage_plan(tmp, max_steps=4, checkpoint_every=1, resume=True)
        try:
            seen["result"] = run_training_stage(reliability_table, seen["plan"], devices=1, final=True)
        finally:
            lock.execute("ROLLBACK")
            lock.close()
    seen["log"] = (stage_dir / "launch.log").read_text()
    return seen


def test_crash_mid_checkpoint_is_never_newest(crashed_then_resumed):
    seen = crashed_then_resumed
    assert seen["partial_exists"]  # the half-written checkpoint-3 was on disk ...
    assert seen["published"] == ["checkpoint-2", "checkpoint-1"]  # ... but never listed, let alone newest
    assert sorted(seen["killed_losses"]) == [1, 2, 3]
    assert not checkpoints.staging_dir(seen["root"], 3).exists()  # the resumed run pruned the stale one


def test_corrupted_checkpoint_is_reported_and_the_previous_resumed(crashed_then_resumed):
    seen = crashed_then_resumed
    assert f"skipping checkpoint checkpoint-2: checksum mismatch in {seen['flipped']}" in seen["log"]
    assert f"resumed from {seen['root'] / 'checkpoint-1'} at step 1" in seen["log"]
    result = seen["result"]
    assert [s for s, _ in result.losses] == [1, 2, 3, 4]
    # steps 2 and 3, re-done from checkpoint-1, repeat the interrupted run's losses (logged with 4 decimals)
    for step in (2, 3):
        assert result.losses[step - 1][1] == pytest.approx(seen["killed_losses"][step], abs=2e-4)


def test_locked_mlflow_store_training_finishes_and_failure_is_recorded(crashed_then_resumed):
    seen = crashed_then_resumed
    result, stage_dir = seen["result"], seen["stage_dir"]
    assert result.steps == 4 and result.mlflow_run_id is None
    assert result.tracking_failures and "database is locked" in result.tracking_failures[0]
    assert read_json(stage_dir / "result.json")["tracking_failures"] == result.tracking_failures
    adapter = Path(result.adapter_dir)
    assert (adapter / "adapter_model.safetensors").is_file()
    assert not [p.name for p in adapter.iterdir() if p.suffix in {".bin", ".pt", ".pth", ".pkl"}]  # safetensors only
    assert "MLflow start_run failed" in seen["log"]  # logged by rank 0, not swallowed
    assert checkpoints.verify_folder(Path(result.adapter_dir), Path(result.adapter_manifest)) is None


def test_rerun_reuses_finished_stage_and_relaunches_on_change(crashed_then_resumed, reliability_table,
                                                              no_fault_env, caplog, tmp_path):
    # On a copy of the finished run: the relaunch below replaces the stage folder, which the other tests of
    # the module fixture read (so they pass in any order).
    tmp = tmp_path / "copy"
    shutil.copytree(crashed_then_resumed["tmp"], tmp)
    plan, first = stage_plan(tmp, max_steps=4, checkpoint_every=1), crashed_then_resumed["result"]
    assert Path(plan.run_dir).is_relative_to(tmp) and (Path(plan.run_dir) / "stage_1cpu_final").is_dir()
    launches = []

    def fake_run_stage(stage_dir, spec, *args, **kwargs):  # stands in for a launch: records that it happened
        launches.append(spec.training)
        return first.model_copy(update={"mlflow_run_id": "relaunched"})

    # same parameters, intact adapter: the stored result, no process launched
    caplog.set_level(logging.INFO, logger=planning.__name__)
    no_fault_env.setattr(planning, "run_stage", fake_run_stage)
    again = run_training_stage(reliability_table, plan, devices=1, final=True)
    assert launches == []
    located = {"reused", "adapter_dir", "adapter_manifest"}  # the copy's own folders, not the original's
    assert again.reused is True and again.model_dump(exclude=located) == first.model_dump(exclude=located)
    assert Path(again.adapter_dir).is_relative_to(tmp) and Path(again.adapter_manifest).is_relative_to(tmp)
    assert "reusing the finished result" in caplog.text
    # a timeout or the resume flag do not change what the stage computes: still reused
    assert run_training_stage(reliability_table, stage_plan(tmp, max_steps=4, checkpoint_every=1, resume=False,
                                                            launch={"timeout_s": 999}), 1, True).reused

    # a changed parameter relaunches
    changed_plan = stage_plan(tmp, max_steps=4, checkpoint_every=1, learning_rate=2e-3)
    changed = run_training_stage(reliability_table, changed_plan, 1, True)
    assert changed.mlflow_run_id == "relaunched" and launches[-1].learning_rate == 2e-3
    assert "spec hash differs" in caplog.text


def test_rerun_relaunches_when_the_adapter_is_corrupted(tmp_path, reliability_table, no_fault_env, caplog):
    """The reuse decision on a finished stage folder whose adapter no longer matches its manifest (no launch)."""
    plan = stage_plan(tmp_path, max_steps=2)
    stage_dir = Path(plan.run_dir) / "stage_1cpu_final"
    adapter = stage_dir / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_model.safetensors").write_bytes(b"\x00" * 256)
    checkpoints.write_folder_manifest(adapter, stage_dir / "adapter.manifest.json")
    spec = stage_spec(plan, reliability_table, 1, final=True)
    result = make_result(stage="stage_1cpu_final", adapter_dir=str(adapter), spec_hash=spec.spec_hash,
                         adapter_manifest=str(stage_dir / "adapter.manifest.json"), losses=[[1, 0.5]])
    result.write(stage_dir / "result.json")
    launches = []
    no_fault_env.setattr(planning, "run_stage",
                         lambda d, s, *a, **k: launches.append(s) or result.model_copy(update={"mlflow_run_id": "new"}))

    assert run_training_stage(reliability_table, plan, 1, True).reused is True and not launches
    _flip_bytes(adapter / "adapter_model.safetensors", at=10)
    caplog.set_level(logging.INFO, logger=planning.__name__)
    assert run_training_stage(reliability_table, plan, 1, True).mlflow_run_id == "new" and len(launches) == 1
    assert "adapter does not verify: checksum mismatch in adapter_model.safetensors" in caplog.text


def test_reexported_unchanged_training_table_keeps_its_bytes(tmp_path):
    """A re-run exports the same rows again (loaded back from Parquet): the file, and so the spec hash, stay."""
    import pyarrow.parquet as pq
    from reliability_helpers import make_table

    plan = stage_plan(tmp_path)
    path = Path(export_training_table(make_table(tmp_path), plan))
    digest = checkpoints.sha256_file(path)
    assert export_training_table(pq.read_table(path), plan) == str(path)
    assert checkpoints.sha256_file(path) == digest
    export_training_table(make_table(tmp_path).slice(0, 4), plan)  # changed rows are written
    assert checkpoints.sha256_file(path) != digest
