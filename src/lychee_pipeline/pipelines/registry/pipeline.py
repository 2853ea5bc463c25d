"""Registry pipeline: one node after evaluation and MLflow logging (part of `full`)."""

from __future__ import annotations

from kedro.pipeline import Node, Pipeline

from .nodes import register_final_model


def create_pipeline(**kwargs) -> Pipeline:
    """Register the run's final model and move the champion alias when it wins the gate."""
    return Pipeline(
        [
            Node(
                register_final_model,
                ["test_records", "test_scores", "stage_results", "mlflow_logging", "params:model", "data_counts",
                 "evaluation_mlflow_metrics", "params:evaluation", "params:training", "params:data_processing",
                 "params:registry"],
                ["registry_outcome", "registry_report"],
                name="register_final_model",
                tags=["registry"],
            ),
        ]
    )
