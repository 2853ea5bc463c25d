"""Real `accelerate launch` stages on CPU: 2 gloo processes in sync, resume after kill -9, NaN gate."""

from __future__ import annotations

import subprocess
import sys

import pytest
from stage_plans import RESUME, worker_plan

from lychee_pipeline.pipelines.training.nodes import check_stage
from lychee_pipeline.runtime.launcher import StageFailed
from lychee_pipeline.training.gate import StageGateError
from lychee_pipeline.training.planning import TrainingPlan, plan_training, run_training_stage, stage_spec


def _plan(tmp_path, gpus=1, **training):
    base = dict(group_size=4, learning_rate=1e-3, warmup_ratio=0.0, scheduler="constant", max_steps=6,
                max_length=512, max_pixels=12544, checkpoint_every=3, keep_last=3, seed=1)
    base.update(training)
    return plan_training({"name_or_path": "builtin:tiny", "lora": {"r": 8}}, base, {"check_steps": {1: 6, 2: 6}},
                         gpus, "cpu", {"name": "t", "output_root": str(tmp_path)})


def test_two_cpu_processes_stay_in_sync(two_process_epoch):
    # One epoch of the 24-record table on 2 processes; the run is shared with test_training_correctness.py.
    plan, result = two_process_epoch["plan"], two_process_epoch["result"]
    assert result.devices == 2 and result.device_type == "cpu"
    assert result.steps == 12 and result.train_pairs == 96  # 12 steps x 2 processes x 1 group of 4 pairs
    assert result.replica_max_diff == 0.0  # gradients all-reduced: identical replicas
    assert len(result.peak_mem_gib) == 2
    check_stage(result, plan)


def test_resume_after_kill_matches_uninterrupted_run(tmp_path, large_image_table, traced, monkeypatch,
                                                     uninterrupted_reference):
    # The plan and its uninterrupted run are shared with test_dataloader_workers.py's resume test (one launch).
    reference = uninterrupted_reference["result"]  # worker_plan(workers=0, **RESUME): 8 steps, checkpoint every 4

    monkeypatch.setenv("LYCHEE_FAULT", "after_step_5")  # SIGKILL after step 5; checkpoint-4 exists
    with pytest.raises(StageFailed, match=r"exited with code .*Full log: .*launch.log"):
        run_training_stage(large_image_table, worker_plan(tmp_path / "killed", **RESUME), devices=1, final=True)
    monkeypatch.delenv("LYCHEE_FAULT")
    resumed = run_training_stage(large_image_table, worker_plan(tmp_path / "killed", resume=True, **RESUME),
                                 devices=1, final=True)
    assert [s for s, _ in resumed.losses] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [x for _, x in resumed.losses] == pytest.approx([x for _, x in reference.losses], abs=1e-6)


def test_gate_stops_injected_nan(tmp_path, training_table_path, monkeypatch):
    monkeypatch.setenv("LYCHEE_FAULT", "nan_loss")
    plan = _plan(tmp_path, max_steps=2)
    result = run_training_stage(training_table_path, plan, devices=1, final=True)
    with pytest.raises(StageGateError, match="'finite loss' failed for stage_1cpu_final: non-finite loss at step 1"):
        check_stage(result, plan)


def test_run_returns_the_result_it_writes(tmp_path, training_table_path, traced):
    """`train.run(spec)` in one plain process (no launcher): rank 0 returns the StageResult it wrote as result.json."""
    spec = stage_spec(TrainingPlan.model_validate(_plan(tmp_path, max_steps=2)), training_table_path, 1, True)
    spec.write(tmp_path / "spec.json")
    code = ("import sys; from pathlib import Path; from lychee_pipeline.training.stage import StageResult, StageSpec; "
            "from lychee_pipeline.training.train import run; spec = StageSpec.read(Path(sys.argv[1])); "
            "result = run(spec); written = StageResult.read(Path(spec.output_dir) / 'result.json'); "
            "print('same' if result == written else 'differs', result.steps, len(result.records_seen))")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "spec.json")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "same 2 2", done.stdout[-2000:]
