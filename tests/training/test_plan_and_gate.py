"""Stage planning (the 1 -> 2 -> 4 ladder, parameter validation) and the gate between stages."""

import math

import pytest
from pydantic import ValidationError

from lychee_pipeline.training.gate import StageGateError, check_stage
from lychee_pipeline.runtime.launcher import check_device_count
from lychee_pipeline.training.planning import CHECK_RUNGS, MAX_GPUS, plan_training, rung_devices, stage_devices

from stage_results import make_result

RUN = {"name": "t", "output_root": "data/06_models/runs"}


@pytest.mark.parametrize("gpus,ladder", [(1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (4, [1, 2, 4]), (8, [1, 2, 4, 8]),
                                         (32, [1, 2, 4, 8, 16, 32]), (48, [1, 2, 4, 8, 16, 32, 48])])
def test_stage_ladder(gpus, ladder):
    assert stage_devices(gpus) == ladder


@pytest.mark.parametrize("gpus", [2, 5, 32, 100, MAX_GPUS])
def test_every_check_stage_of_the_ladder_has_a_slot(gpus):
    """No rung is silently dropped: every check stage of the ladder is a slot of the staged pipeline."""
    slots = _plan_for(gpus).stage_slots()
    assert len(slots) == CHECK_RUNGS + 1 and slots[-1].final and slots[-1].devices == gpus
    assert [s.devices for s in slots[:-1] if s.devices is not None] == stage_devices(gpus)[:-1]
    assert [d for s, d in zip(slots, rung_devices()) if s.devices is not None] == stage_devices(gpus)[:-1]


def test_gpus_32_runs_the_16_device_check_stage():
    assert 16 in [s.devices for s in _plan_for(32).stage_slots() if not s.final]


def test_gpus_beyond_the_slots_is_one_line_error():
    with pytest.raises(ValueError, match=rf"^parameter gpus={MAX_GPUS + 1} needs more check stages") as error:
        _plan_for(MAX_GPUS + 1)
    assert "\n" not in str(error.value)


def _plan_for(gpus):
    return plan_training({}, {}, {}, gpus, "cpu", RUN)  # on CPU, gpus=N plans N processes (nothing launches)


def _plan(**training):
    return plan_training({}, training, {}, 2, "cpu", RUN)


def test_plan_on_cpu_runs_processes():
    plan = _plan()
    assert plan.device_type == "cpu" and plan.ladder == [1, 2]


@pytest.mark.parametrize(
    "bad,name",
    [({"learning_rate": -1e-4}, "learning_rate"), ({"loss": "hinge"}, "loss"), ({"group_size": "eight"}, "group_size")],
)
def test_bad_parameters_name_the_parameter(bad, name):
    with pytest.raises(ValidationError, match=name):
        _plan(**bad)


def test_unknown_model_key_is_a_one_line_error():
    with pytest.raises(ValueError) as error:
        plan_training({"lora_rank": 8}, {}, {}, 1, "cpu", RUN)
    assert str(error.value) == "invalid parameter model.lora_rank: Unexpected keyword argument (got 8)"
    with pytest.raises(ValueError, match=r"^invalid parameter model\.lora\.rank: Unexpected keyword argument"):
        plan_training({"lora": {"rank": 8}}, {}, {}, 1, "cpu", RUN)


def test_qlora_on_cpu_is_refused():
    with pytest.raises(ValueError, match="qlora needs a CUDA GPU"):
        plan_training({"finetune": "qlora"}, {}, {}, 1, "cpu", RUN)


def test_too_many_gpus_refused_naming_both_numbers():
    import torch

    if torch.cuda.is_available():
        visible = torch.cuda.device_count()
        with pytest.raises(ValueError, match=f"gpus={visible + 1}.*{visible} visible"):
            check_device_count(visible + 1, "cuda")
    else:
        with pytest.raises(ValueError, match="gpus=4 asks for more GPUs than the 0 visible"):
            check_device_count(4, "cuda")


def _result(losses, devices=2, diff=0.0):
    return make_result(stage="stage_2cpu", devices=devices, losses=[[i + 1, x] for i, x in enumerate(losses)],
                       replica_max_diff=diff, pairs_per_s=1.0, adapter_dir="/tmp/x/adapter")


def test_gate_passes_a_falling_loss():
    plan = _plan()
    assert check_stage(_result([1.0, 0.9, 0.8, 0.7, 0.6, 0.5]), plan.stages.gate).stage == "stage_2cpu"


def test_gate_stops_non_finite_loss_naming_step_and_logs():
    with pytest.raises(StageGateError, match=r"'finite loss' failed .* step 3 \(logs: /tmp/x/launch.log\)"):
        check_stage(_result([1.0, 0.9, math.nan, 0.7]), _plan().stages.gate)


def test_gate_stops_loss_that_does_not_fall():
    with pytest.raises(StageGateError, match="'loss falls' failed"):
        check_stage(_result([0.5, 0.5, 0.6, 0.7, 0.8, 0.9]), _plan().stages.gate)


def test_gate_stops_replicas_out_of_sync():
    with pytest.raises(StageGateError, match="'replicas in sync' failed"):
        check_stage(_result([1.0, 0.8, 0.6], diff=0.1), _plan().stages.gate)


def test_the_slots_a_run_does_not_use_are_named_once_in_the_log(caplog):
    """`full --params gpus=2` shows a "Running node" line for every slot up to train_stage_128: one line says which
    of them run nothing."""
    import logging

    from lychee_pipeline.pipelines.training.nodes import assign_stage_slots

    with caplog.at_level(logging.INFO):
        slots = assign_stage_slots(_plan_for(2))
    assert [s.devices for s in slots][:3] == [1, None, None] and slots[-1].model_dump() == {"devices": 2, "final": True}
    line = next(r.getMessage() for r in caplog.records if "are not used" in r.getMessage())
    assert line.startswith("stage slots train_stage_2, train_stage_4,") and "train_stage_128" in line
    assert "train_stage_1," not in line and "with gpus=2 (its stages: 1 -> 2 devices)" in line
    assert "Kedro lists these as run and completed nodes and kedro-viz shows them, but they launch nothing" in line


def test_the_loss_reads_the_training_temperature_not_its_own_default():
    """`LossOptions` is built by keyword from TrainingParams: the default 0.05, or the configured value."""
    from lychee_pipeline.reranker.losses import LossOptions
    from lychee_pipeline.training.config import TrainingParams

    assert TrainingParams().loss_options() == LossOptions(group_size=8, temperature=0.05)
    assert TrainingParams(group_size=4, temperature=0.2).loss_options() == LossOptions(group_size=4, temperature=0.2)
