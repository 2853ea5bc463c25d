"""Where the figures of a run go in MLflow: the stage runs carry their own training figures, the parent the rest."""

from __future__ import annotations

import mlflow

from lychee_pipeline.pipelines.reporting.nodes import log_run_to_mlflow, stage_training_metrics

METRICS = {
    "test.mrr_at_10.base": 0.2, "test.mrr_at_10.stage_1cpu": 0.5, "test.mrr_at_10.finetuned": 0.5,
    "business.expected_ctr_at_10.stage_1cpu": 0.3, "scaling.stage_1cpu.pairs_per_s": 12.0,
    "training.stage_1cpu.final_loss": 0.4, "scaling.stage_1cpu.mrr_at_10": 0.5, "scaling.stage_2cpu.pairs_per_s": 20.0,
}


def test_stage_training_metrics_keep_only_the_stage_own_training_figures():
    assert stage_training_metrics(METRICS, "stage_1cpu") == {"scaling.pairs_per_s": 12.0, "training.final_loss": 0.4}


def test_stage_run_gets_training_figures_and_parent_the_rest(tmp_path):
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = mlflow.set_experiment("layout")
    client = mlflow.MlflowClient()
    try:
        with mlflow.start_run(run_name="smoke") as parent:
            child = client.create_run(experiment.experiment_id, run_name="stage_1cpu",
                                      tags={"mlflow.parentRunId": parent.info.run_id})
            # no adapter to log as the model here: that part fails (recorded), after the metrics are logged
            logged = log_run_to_mlflow(METRICS, {"lines_in": 10}, [
                {"stage": "stage_1cpu", "mlflow_run_id": child.info.run_id, "adapter_dir": str(tmp_path / "none")}],
                {"name_or_path": "builtin:tiny"})
        stage = client.get_run(child.info.run_id).data.metrics
        assert set(stage) == {"scaling.pairs_per_s", "training.final_loss"}
        top = client.get_run(parent.info.run_id).data.metrics
        assert {"test.mrr_at_10.stage_1cpu", "business.expected_ctr_at_10.stage_1cpu", "data.lines_in"} <= set(top)
        assert logged["metrics"] == len(METRICS) + 1
    finally:
        mlflow.set_tracking_uri(None)
