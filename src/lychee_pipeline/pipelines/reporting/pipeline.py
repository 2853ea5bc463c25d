"""Reporting pipeline: MLflow logging and the run summary, after evaluation."""

from __future__ import annotations

from kedro.pipeline import Node, Pipeline

from .nodes import log_run_to_mlflow, summarize_run


def create_pipeline(**kwargs) -> Pipeline:
    """Log the run to MLflow and summarise it."""
    return Pipeline(
        [
            Node(log_run_to_mlflow, ["evaluation_mlflow_metrics", "data_counts", "stage_results", "params:model"],
                 "mlflow_logging", name="log_run_to_mlflow", tags=["reporting"]),
            Node(summarize_run, ["data_counts", "stage_results", "evaluation_mlflow_metrics", "mlflow_logging"],
                 "run_summary", name="summarize_run", tags=["reporting"]),
        ]
    )
