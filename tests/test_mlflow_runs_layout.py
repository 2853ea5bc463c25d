"""Where the figures of a run go in MLflow: the stage runs carry their own training figures, the parent the rest."""

from __future__ import annotations

import mlflow
import pytest
from stage_results import make_result

from lychee_pipeline.evaluation.report import build_metrics_document, mlflow_metrics, stage_run_metrics
from lychee_pipeline.evaluation.scaling import scaling_report
from lychee_pipeline.pipelines.reporting.nodes import log_run_to_mlflow

STAGES = [make_result(stage="stage_1cpu", devices=1, pairs_per_s=12.0, steps=100, step_seconds=[],
                      losses=[[1, 0.9], [2, 0.4]]),
          make_result(stage="stage_2cpu", devices=2, pairs_per_s=20.0, steps=100, step_seconds=[])]
SCALING = scaling_report(STAGES, 1000, mrr_at_10={"stage_1cpu": 0.5})
STAGE_RUN_FIGURES = {"scaling.devices", "scaling.wall_time_s", "scaling.pairs_per_s", "scaling.scaling_efficiency",
                     "scaling.peak_mem_gib_max", "scaling.epoch_time_s", "scaling.device_hours_per_epoch",
                     "scaling.relative_device_hours", "training.final_loss"}
METRICS = {
    "test.mrr_at_10.base": 0.2, "test.mrr_at_10.stage_1cpu": 0.5, "test.mrr_at_10.finetuned": 0.5,
    "business.expected_ctr_at_10.stage_1cpu": 0.3,
    **mlflow_metrics(build_metrics_document({}, {}, SCALING, {s.stage: s.losses for s in STAGES})),
}


def test_stage_training_metrics_keep_only_the_stage_own_training_figures():
    own = stage_run_metrics(SCALING.row("stage_1cpu"), "stage_1cpu", STAGES[0].losses)
    assert set(own) == STAGE_RUN_FIGURES  # the test figure scaling.stage_1cpu.mrr_at_10 stays on the parent
    assert own["scaling.pairs_per_s"] == 12.0 and own["training.final_loss"] == 0.4
    # the same figures as the parent run's, under the parent's names (scaling.<stage>.<field>)
    for name, value in own.items():
        group, field = name.split(".")
        assert METRICS[f"{group}.stage_1cpu.{field}"] == pytest.approx(value)
    assert METRICS["scaling.stage_1cpu.mrr_at_10"] == 0.5 and METRICS["scaling.stage_2cpu.pairs_per_s"] == 20.0


def test_stage_run_gets_training_figures_and_parent_the_rest(tmp_path):
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = mlflow.set_experiment("layout")
    client = mlflow.MlflowClient()
    try:
        with mlflow.start_run(run_name="smoke") as parent:
            child = client.create_run(experiment.experiment_id, run_name="stage_1cpu",
                                      tags={"mlflow.parentRunId": parent.info.run_id})
            # no adapter to log as the model here: that part fails (recorded), after the metrics are logged
            result = STAGES[0].model_copy(update={"mlflow_run_id": child.info.run_id,
                                                  "adapter_dir": str(tmp_path / "none")})
            logged = log_run_to_mlflow(METRICS, {"lines_in": 10}, [result.model_dump()],
                                       {"name_or_path": "builtin:tiny"}, None, SCALING.model_dump())
        stage = client.get_run(child.info.run_id).data.metrics
        assert set(stage) == STAGE_RUN_FIGURES
        assert stage["scaling.pairs_per_s"] == 12.0 and stage["training.final_loss"] == 0.4
        top = client.get_run(parent.info.run_id).data.metrics
        assert {"test.mrr_at_10.stage_1cpu", "business.expected_ctr_at_10.stage_1cpu", "data.lines_in"} <= set(top)
        assert logged["metrics"] == len(METRICS) + 1
        assert logged["failures"]  # the missing adapter
    finally:
        mlflow.set_tracking_uri(None)


def test_a_partial_stage_result_is_a_one_line_error_naming_the_stage():
    with pytest.raises(ValueError) as error:
        log_run_to_mlflow(METRICS, {}, [{"stage": "stage_1cpu", "adapter_dir": "x"}], {"name_or_path": "x"})
    message = str(error.value)
    assert "\n" not in message and message.startswith("stage result 'stage_1cpu' is not a valid StageResult")
    assert "devices: Field required" in message
