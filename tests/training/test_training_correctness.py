"""Training that is correct on N processes: real `accelerate launch` stages on CPU (1, 2 and 3 gloo processes).

The learning rate follows the analytic schedule of the run's optimizer step whatever the process count and
accumulation; every record is seen once per epoch; a resume in epoch 1 continues the same sequence; a
non-finite step never reaches the weights and a run of them stops the stage naming the last good checkpoint.
"""

from __future__ import annotations

import copy
import math

import pytest
from stage_plans import RECORDS, epoch_plan

from lychee_pipeline.pipelines.training.nodes import check_stage
from lychee_pipeline.training.gate import StageGateError
from lychee_pipeline.training.planning import run_training_stage
from lychee_pipeline.runtime.launcher import StageFailed


def cosine_lr(step: int, total: int, warmup: int, base: float) -> float:
    """Written out here, independently of the project's schedule module."""
    if step < warmup:
        return base * step / warmup
    return base * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


@pytest.mark.parametrize(
    "processes, accumulation, total_steps",
    [(1, 1, 24), (2, 1, 12), (2, 2, 6)],  # one epoch of the 24 records (the 2-process runs: conftest.py)
)
def test_learning_rate_follows_the_schedule_on_n_processes(tmp_path, training_table_path, traced, processes,
                                                           accumulation, total_steps, request):
    shared = {(2, 1): "two_process_epoch", (2, 2): "two_process_accumulation"}.get((processes, accumulation))
    if shared:  # a stage run of the session that other tests read too (conftest.py)
        run = request.getfixturevalue(shared)
        plan, result = run["plan"], run["result"]
    else:
        plan = epoch_plan(tmp_path, gpus=processes, gradient_accumulation_steps=accumulation)
        result = run_training_stage(training_table_path, plan, devices=processes, final=True)
    assert result.steps == total_steps
    warmup = int(0.25 * total_steps)
    logged = dict((step, lr) for step, lr in result.learning_rates)
    assert sorted(logged) == list(range(1, total_steps + 1))
    for step, lr in logged.items():
        assert lr == pytest.approx(cosine_lr(step, total_steps, warmup, 1e-3), rel=1e-9, abs=1e-15), step
    assert logged[warmup] == pytest.approx(1e-3)  # warm-up ends at the planned step, not N times sooner
    assert logged[total_steps] == pytest.approx(0.0, abs=1e-15)  # one decay, ending at zero
    # Every record exactly once in the epoch, over all ranks and micro-steps.
    seen = sorted(i for _, indices in result.records_seen for i in indices)
    assert seen == list(range(RECORDS))
    check_stage(result, plan)  # the gate's schedule check passes


def test_three_processes_see_every_record_once_per_epoch_with_an_uneven_split(tmp_path, training_table_path, traced):
    """24 records over 3 ranks × 3 per batch: the last global batch has 6 real groups and 3 zero-weight pads."""
    plan = epoch_plan(tmp_path, gpus=3, per_device_batch_size=3, epochs=2, warmup_ratio=0.0)
    result = run_training_stage(training_table_path, plan, devices=3, final=True)
    assert result.devices == 3 and result.steps == 6  # 27 slots = 3 global batches per epoch
    for epoch in (0, 1):
        slots = [i for step, idx in result.records_seen if 3 * epoch < step <= 3 * epoch + 3 for i in idx]
        assert sorted(i for i in slots if i >= 0) == list(range(RECORDS)), epoch  # no record twice, none missed
        assert slots.count(-1) == 3
    assert all(math.isfinite(x) for _, x in result.losses) and result.replica_max_diff == 0.0
    check_stage(result, plan)


def test_gate_refuses_a_schedule_that_did_not_end_where_planned(uninterrupted_reference):
    # Any finished stage will do: the session's uninterrupted reference (cosine to zero over 8 steps), a copy.
    plan, result = uninterrupted_reference["plan"], copy.deepcopy(uninterrupted_reference["result"])
    result.learning_rates[-1][1] = 5e-4  # as if the scheduler had been stepped the wrong number of times
    with pytest.raises(StageGateError, match="'learning-rate schedule' failed .* final learning rate 5.000e-04"):
        check_stage(result, plan)


def test_resume_in_the_second_epoch_on_two_processes_continues_the_same_run(tmp_path, training_table_path,
                                                                            traced, monkeypatch):
    """2 processes, 2 epochs of 12 steps, cosine: killed after step 17 (checkpoint 15), then resumed."""
    kwargs = dict(gpus=2, epochs=2, checkpoint_every=5)
    reference = run_training_stage(training_table_path, epoch_plan(tmp_path / "ref", **kwargs), devices=2,
                                   final=True)
    assert reference.steps == 24
    orders = [sorted(i for s, idx in reference.records_seen if lo < s <= lo + 12 for i in idx) for lo in (0, 12)]
    assert orders == [list(range(RECORDS))] * 2  # each epoch sees every record once
    epoch_0 = [idx for s, idx in reference.records_seen if s <= 12]
    epoch_1 = [idx for s, idx in reference.records_seen if s > 12]
    assert epoch_0 != epoch_1  # a new permutation in epoch 1

    monkeypatch.setenv("LYCHEE_FAULT", "after_step_17")
    with pytest.raises(StageFailed, match="exited with code"):
        run_training_stage(training_table_path, epoch_plan(tmp_path / "killed", **kwargs), devices=2, final=True)
    monkeypatch.delenv("LYCHEE_FAULT")
    resumed = run_training_stage(training_table_path, epoch_plan(tmp_path / "killed", resume=True, **kwargs),
                                 devices=2, final=True)
    log = (tmp_path / "killed" / "t" / "stage_2cpu_final" / "launch.log").read_text()
    assert "resumed from" in log and "checkpoint-15 at step 15 (epoch 1)" in log
    # The resumed part saw the records of the uninterrupted run in the same order ...
    assert [x for x in resumed.records_seen] == [x for x in reference.records_seen if x[0] > 15]
    # ... with the restored optimizer and scheduler: the same losses and learning rates at every step.
    assert [s for s, _ in resumed.losses] == list(range(1, 25))
    assert [x for _, x in resumed.losses] == pytest.approx([x for _, x in reference.losses], abs=1e-5)
    assert [s for s, _ in resumed.learning_rates] == list(range(1, 25))
    assert [x for _, x in resumed.learning_rates] == pytest.approx(
        [x for _, x in reference.learning_rates], rel=1e-9, abs=1e-15)
    check_stage(resumed, epoch_plan(tmp_path / "killed", resume=True, **kwargs))


def test_a_non_finite_step_is_skipped_and_training_goes_on(tmp_path, training_table_path, traced, monkeypatch):
    monkeypatch.setenv("LYCHEE_FAULT", "nan_loss_at_3")
    plan = epoch_plan(tmp_path, max_steps=5)
    result = run_training_stage(training_table_path, plan, devices=1, final=True)
    assert result.steps == 5
    assert [s for s, *_ in result.skipped_steps] == [3]
    assert [s for s, _ in result.losses] == [1, 2, 4, 5]
    assert all(math.isfinite(x) for _, x in result.losses)
    assert len(result.learning_rates) == 5  # the schedule still ends where planned
    check_stage(result, plan)


def test_non_finite_steps_in_a_row_stop_the_stage_naming_the_last_finite_checkpoint(
    tmp_path, training_table_path, traced, monkeypatch
):
    monkeypatch.setenv("LYCHEE_FAULT", "nan_loss_from_3")
    plan = epoch_plan(tmp_path, gpus=2, max_steps=10, checkpoint_every=2, keep_last=1, max_nonfinite_steps=3)
    with pytest.raises(StageFailed, match=r"3 non-finite steps in a row \(steps 3-5\); last finite checkpoint: "
                                          r"\S*checkpoint-2"):
        run_training_stage(training_table_path, plan, devices=2, final=True)
    checkpoints = plan.run_dir + "/stage_2cpu_final/checkpoints"
    import os

    assert sorted(os.listdir(checkpoints)) == ["checkpoint-2"]  # kept: nothing was saved during the run of NaNs

    # What the message says to do: resume from it at a lower learning rate. The restored schedule takes the new
    # rate from step 3 on (cosine over 10 steps, no warm-up here: int(0.25 x 10) = 2 warm-up steps).
    monkeypatch.delenv("LYCHEE_FAULT")
    resumed_plan = epoch_plan(tmp_path, gpus=2, max_steps=10, checkpoint_every=2, keep_last=1, max_nonfinite_steps=3,
                         learning_rate=2e-4, resume=True)
    result = run_training_stage(training_table_path, resumed_plan, devices=2, final=True)
    log = open(plan.run_dir + "/stage_2cpu_final/launch.log").read()
    assert "checkpoint-2 at step 2" in log and "learning rate changed on resume" in log
    rates = dict((s, lr) for s, lr in result.learning_rates)
    assert rates[2] == pytest.approx(1e-3)  # before the resume: the old rate at the end of warm-up
    for step in range(3, 11):
        assert rates[step] == pytest.approx(cosine_lr(step, 10, 2, 2e-4), rel=1e-9, abs=1e-15), step
    assert result.skipped_steps == [] and [s for s, _ in result.losses] == list(range(1, 11))
    check_stage(result, resumed_plan)


def test_listwise_batches_of_two_and_a_resolution_schedule_on_two_processes(tmp_path, training_table_path, traced):
    """Options no other stage test runs: per_device_batch_size 2, listwise loss, a resolution ramp, linear decay."""
    plan = epoch_plan(tmp_path, gpus=2, per_device_batch_size=2, loss="listwise", scheduler="linear", warmup_ratio=0.0,
                 resolution_schedule=[{"start": 0.0, "max_pixels": 3136}, {"start": 0.5, "max_pixels": 12544}])
    result = run_training_stage(training_table_path, plan, devices=2, final=True)
    assert result.steps == 6 and result.train_pairs == 6 * 2 * 2 * 4
    assert sorted(i for _, idx in result.records_seen for i in idx) == list(range(RECORDS))
    assert [lr for _, lr in result.learning_rates] == pytest.approx([1e-3 * (6 - s) / 6 for s in range(1, 7)])
    assert all(math.isfinite(x) for _, x in result.losses) and result.replica_max_diff == 0.0
    check_stage(result, plan)
