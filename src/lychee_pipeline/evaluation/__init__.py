"""Kedro-free evaluation: ranking metrics, business proxies, the scaling report, the report and plots."""

from lychee_pipeline.evaluation.business import (
    business_metrics,
    click_probabilities,
    compare_business,
    examination_probabilities,
    tail_items,
    uplift,
)
from lychee_pipeline.evaluation.metrics import (
    METRIC_NAMES,
    evaluate_models,
    paired_comparison,
    per_query_metrics,
    rank_candidates,
)
from lychee_pipeline.evaluation.report import (
    build_metrics_document,
    build_plots,
    figure_png,
    mlflow_metrics,
    render_markdown,
)
from lychee_pipeline.evaluation.params import EvaluationParams
from lychee_pipeline.evaluation.scaling import ScalingReport, ScalingRow, device_label, scaling_report

__all__ = [
    "METRIC_NAMES",
    "EvaluationParams",
    "ScalingReport",
    "ScalingRow",
    "build_metrics_document",
    "build_plots",
    "business_metrics",
    "click_probabilities",
    "compare_business",
    "device_label",
    "evaluate_models",
    "examination_probabilities",
    "figure_png",
    "mlflow_metrics",
    "paired_comparison",
    "per_query_metrics",
    "rank_candidates",
    "render_markdown",
    "scaling_report",
    "tail_items",
    "uplift",
]
