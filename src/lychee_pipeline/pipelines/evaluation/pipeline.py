"""Evaluation pipeline: score the test split, ranking and business metrics, scaling report, report.

Inputs: ``test_records`` (model-input table of the test split), ``stage_results`` (list of stage
result dicts, each with ``adapter_dir`` and ``losses``), ``params:model`` (``name_or_path``) and
``params:evaluation``, and ``params:gpus`` / ``params:device`` / ``params:training`` (how many processes
score, on which device, with which launch settings and processing defaults).
Outputs: ``test_scores`` (07), ``evaluation_scoring`` (per model: pairs, processes, time, pairs/s, whether
the scores were sampled or reused from the score cache), ``ranking_metrics``, ``business_metrics``, ``scaling_report``,
``evaluation_metrics``, ``evaluation_report``, ``evaluation_plots`` (08) and
``evaluation_mlflow_metrics`` (flat ``{name: float}``).
"""

from __future__ import annotations

from kedro.pipeline import Pipeline, node

from lychee_pipeline.pipelines.evaluation.nodes import (
    build_report,
    compute_business_metrics,
    compute_ranking_metrics,
    compute_scaling_report,
    score_test_set,
)


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            node(
                score_test_set,
                inputs=["test_records", "stage_results", "params:model", "params:evaluation", "params:gpus",
                        "params:device", "params:training"],
                outputs=["test_scores", "evaluation_scoring"],
                name="score_test_set",
                tags=["evaluation", "scoring"],
            ),
            node(
                compute_ranking_metrics,
                inputs=["test_scores", "params:evaluation"],
                outputs="ranking_metrics",
                name="compute_ranking_metrics",
                tags=["evaluation"],
            ),
            node(
                compute_business_metrics,
                inputs=["test_scores", "params:evaluation"],
                outputs="business_metrics",
                name="compute_business_metrics",
                tags=["evaluation"],
            ),
            node(
                compute_scaling_report,
                inputs=["stage_results", "ranking_metrics", "params:evaluation"],
                outputs="scaling_report",
                name="compute_scaling_report",
                tags=["evaluation"],
            ),
            node(
                build_report,
                inputs=["ranking_metrics", "business_metrics", "scaling_report", "stage_results", "evaluation_scoring"],
                outputs=["evaluation_metrics", "evaluation_report", "evaluation_plots", "evaluation_mlflow_metrics"],
                name="build_evaluation_report",
                tags=["evaluation", "report"],
            ),
        ]
    )
