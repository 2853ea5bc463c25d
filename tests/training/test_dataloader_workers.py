"""Collation in DataLoader worker processes changes nothing a stage computes (real `accelerate launch` stages, CPU).

Negative sampling, the epoch order and the resolution schedule's pixel budget are functions of (seed, epoch, record,
step) carried by the sampler's keys, so batches collated ahead of time in other processes are the batches the
training process would have built; losses are read back from the device only on logging steps.
"""

from __future__ import annotations

import pytest
from stage_plans import ACCUMULATION, RESUME, worker_plan

from lychee_pipeline.pipelines.training.nodes import check_stage
from lychee_pipeline.training.planning import run_training_stage
from lychee_pipeline.runtime.launcher import StageFailed

# large_image_table, traced: tests/training/conftest.py


def _losses(result):
    return [x for _, x in result.losses]


def test_two_workers_give_the_losses_of_in_process_collation_on_two_processes(tmp_path, large_image_table, traced,
                                                                             two_process_accumulation):
    """2 gloo processes, accumulation 2, a resolution ramp at half-way; logging every 4th step only."""
    kwargs = ACCUMULATION  # gpus=2, gradient_accumulation_steps=2, max_steps=6
    inline = two_process_accumulation["result"]  # worker_plan(workers=0, **ACCUMULATION), run once per session
    workers = run_training_stage(large_image_table, worker_plan(tmp_path / "w2", workers=2, log_every=4, **kwargs),
                                 devices=2, final=True)
    assert inline.dataloader == {"num_workers": 0, "pin_memory": False}
    assert workers.dataloader["num_workers"] == 2 and workers.dataloader["persistent_workers"] is True
    assert workers.records_seen == inline.records_seen
    assert [s for s, _ in workers.losses] == list(range(1, 7))  # every step's loss, though read back in bulk
    assert _losses(workers) == pytest.approx(_losses(inline), abs=1e-6)
    assert workers.truncation == inline.truncation and workers.truncation["pairs"] == 6 * 2 * 4  # rank 0: 6 steps x 2 micro-batches x 4 pairs
    log = (tmp_path / "w2" / "t" / "stage_2cpu_final" / "launch.log").read_text()
    assert "data loader: num_workers=2" in log
    # where each step's time went, per optimizer step (2 micro-batches each), summed over steps 2-6
    timing = workers.timing
    assert [row[0] for row in timing["per_step"]] == list(range(1, 7))
    assert all(row[1] >= 0 and row[2] > 0 and row[3] >= row[1] + row[2] for row in timing["per_step"])
    assert timing["steps"] == 5 and timing["first_step"] == 2 and 0 <= timing["host_blocked_on_data_share"] < 1
    assert timing["readbacks"] == 3  # step 1, then the logging steps 4 and 6: no read-back on the others
    assert "step time (steps 2-6): step_wall_ms" in log
    check_stage(workers, worker_plan(tmp_path / "w2", workers=2, log_every=4, **kwargs))


def test_the_resolution_ramp_reaches_the_workers(tmp_path, large_image_table, traced):
    """Guard for the test above: the ramp changes the losses, so equal losses mean equal budgets per step."""
    kwargs = dict(max_steps=4, warmup_ratio=0.0, scheduler="constant")
    ramp = run_training_stage(large_image_table, worker_plan(tmp_path / "ramp", workers=2, **kwargs), devices=1,
                              final=True)
    flat = run_training_stage(large_image_table,
                              worker_plan(tmp_path / "flat", workers=2, resolution_schedule=[], **kwargs),
                              devices=1, final=True)
    assert _losses(ramp)[:2] != pytest.approx(_losses(flat)[:2], abs=1e-6)  # 56x56 budget before half-way


def test_a_resumed_run_with_workers_equals_an_uninterrupted_one(tmp_path, large_image_table, traced, monkeypatch,
                                                                uninterrupted_reference):
    """Killed after step 5 (checkpoint 4) with 2 workers, resumed with 2 workers: the run without workers."""
    kwargs = RESUME  # max_steps=8, checkpoint_every=4, log_every=3
    reference = uninterrupted_reference["result"]  # worker_plan(workers=0, **RESUME), 1 process, run once per session
    monkeypatch.setenv("LYCHEE_FAULT", "after_step_5")
    with pytest.raises(StageFailed, match="exited with code"):
        run_training_stage(large_image_table, worker_plan(tmp_path / "killed", workers=2, **kwargs), devices=1,
                           final=True)
    monkeypatch.delenv("LYCHEE_FAULT")
    resumed = run_training_stage(large_image_table, worker_plan(tmp_path / "killed", workers=2, resume=True, **kwargs),
                                 devices=1, final=True)
    log = (tmp_path / "killed" / "t" / "stage_1cpu_final" / "launch.log").read_text()
    assert "checkpoint-4 at step 4" in log and "num_workers=2" in log
    assert resumed.records_seen == [x for x in reference.records_seen if x[0] > 4]
    assert [s for s, _ in resumed.losses] == list(range(1, 9))
    assert _losses(resumed) == pytest.approx(_losses(reference), abs=1e-6)
