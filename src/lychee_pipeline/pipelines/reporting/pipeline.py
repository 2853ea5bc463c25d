"""Reporting pipeline: MLflow logging and the run summary, after evaluation."""

from __future__ import annotations

from kedro.pipeline import Node, Pipeline

from .nodes import log_run_to_mlflow, serving_config, summarize_run


def create_pipeline(registry: bool = False, **kwargs) -> Pipeline:
    """Log the run to MLflow and summarise it; with ``registry`` the summary also reads ``registry_outcome``."""
    summary_inputs = ["data_counts", "stage_results", "evaluation_mlflow_metrics", "mlflow_logging"]
    return Pipeline(
        [
            Node(serving_config, ["raw_source", "params:evaluation", "params:serving"], "serving_config",
                 name="build_serving_config", tags=["reporting"]),
            Node(log_run_to_mlflow,
                 ["evaluation_mlflow_metrics", "data_counts", "stage_results", "params:model", "serving_config",
                  "scaling_report"],
                 "mlflow_logging", name="log_run_to_mlflow", tags=["reporting"]),
            Node(summarize_run, summary_inputs + (["registry_outcome"] if registry else []),
                 "run_summary", name="summarize_run", tags=["reporting"]),
        ]
    )
