"""Evaluation nodes: each a few lines over :mod:`lychee_pipeline.evaluation` (scoring, metrics, report)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from lychee_pipeline.evaluation import (
    build_metrics_document,
    build_plots,
    compare_business,
    evaluate_models,
    mlflow_metrics,
    rank_candidates,
    render_markdown,
    scaling_report,
)
from lychee_pipeline.evaluation import scoring
from lychee_pipeline.evaluation.params import EvaluationParams, evaluation_params
from lychee_pipeline.evaluation.scaling import ScalingReport
from lychee_pipeline.evaluation.scoring import BASE, jsonable
from lychee_pipeline.evaluation.scoring_report import add_scoring, scoring_mlflow_metrics
from lychee_pipeline.reranker.model import ModelConfig
from lychee_pipeline.runtime.errors import validated
from lychee_pipeline.training.config import TrainingParams
from lychee_pipeline.training.stage import StageResult, as_stage_results


def score_test_set(
    test_records: Any,
    stage_results: Sequence[Mapping[str, Any]] | None,
    model: Mapping[str, Any],
    evaluation: Mapping[str, Any],
    gpus: int = 1,
    device: str = "auto",
    training: Any = None,  # params:training (a dict, or TrainingParams); a Union hint here would make Kedro warn
) -> tuple[pd.DataFrame, dict[str, Any]]:
    """The long scores table of the base model and each stage's adapter, and the scoring figures
    (:func:`lychee_pipeline.evaluation.scoring.score_test_set`)."""
    return scoring.score_test_set(
        test_records, as_stage_results(stage_results), validated(ModelConfig, "model", model),
        evaluation_params(evaluation), gpus, device, validated(TrainingParams, "training", training or {}))


def _model_tables(scores: pd.DataFrame) -> dict[str, pd.DataFrame]:
    return {str(name): group.drop(columns="model") for name, group in scores.groupby("model", sort=False)}


def compute_ranking_metrics(scores: pd.DataFrame, evaluation: Mapping[str, Any]) -> dict[str, Any]:
    """MRR@10, NDCG@10, Recall@1/5/10, MAP per model, by task type and language, and vs base."""
    params = evaluation_params(evaluation)
    return jsonable(evaluate_models(
        _model_tables(scores),
        base=BASE,
        seed=params.seed,
        n_resamples=params.significance.n_resamples,
        confidence_level=params.significance.confidence_level,
    ))


def compute_business_metrics(scores: pd.DataFrame, evaluation: Mapping[str, Any]) -> dict[str, Any]:
    """Expected CTR, clicks and purchases, long-tail share and coverage at each k, vs base."""
    params = evaluation_params(evaluation)
    ranked = {name: rank_candidates(table, params.seed) for name, table in _model_tables(scores).items()}
    return jsonable(compare_business(
        ranked,
        base=BASE,
        ks=params.business.ks,
        examination=params.business.examination,
        tail_fraction=params.business.tail_fraction,
    ))


def _full_train_pairs(results: Sequence[StageResult], params: EvaluationParams) -> tuple[int | None, str]:
    if params.scaling.full_train_pairs:
        return params.scaling.full_train_pairs, "parameter evaluation.scaling.full_train_pairs"
    for result in results:
        if result.full_train_pairs:
            return result.full_train_pairs, "stage results (full_train_pairs)"
    if results:
        return max(r.train_pairs for r in results), "largest stage's train_pairs (assumed one epoch)"
    return None, "none"


def compute_scaling_report(
    stage_results: Sequence[Mapping[str, Any]] | None,
    ranking_metrics: Mapping[str, Any],
    evaluation: Mapping[str, Any],
) -> dict[str, Any]:
    """The scaling table over the stages; each stage's MRR@10 is taken from the test metrics."""
    results = as_stage_results(stage_results)
    models = ranking_metrics.get("models") or {}
    mrr = {r.stage: models[r.stage]["overall"]["mrr_at_10"] for r in results if r.stage in models}
    full, source = _full_train_pairs(results, evaluation_params(evaluation))
    report = scaling_report(results, full, mrr).model_copy(update={"full_train_pairs_source": source})
    return jsonable(report.model_dump())


def build_report(
    ranking_metrics: Mapping[str, Any],
    business_metrics: Mapping[str, Any],
    scaling: Mapping[str, Any],
    stage_results: Sequence[Mapping[str, Any]] | None,
    scoring: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], str, dict[str, Any], dict[str, float]]:
    """The metrics document, the Markdown report, the plots ``{file name: Figure}`` and MLflow metrics.

    ``scoring`` (from :func:`score_test_set`) adds the time and pairs/s per model, which scores were sampled
    (check stages) and which were reused from the score cache, to the document, the report and MLflow.
    """
    results = as_stage_results(stage_results)
    losses = {r.stage: r.losses for r in results}
    learning_rates = {r.stage: r.learning_rates for r in results}
    typed_scaling = ScalingReport.model_validate(scaling) if scaling is not None else None
    document = jsonable(build_metrics_document(ranking_metrics, business_metrics, typed_scaling, losses))
    if scoring:
        document["scoring"] = jsonable(scoring)
    report = add_scoring(render_markdown(document), scoring)
    metrics = {**mlflow_metrics(document), **scoring_mlflow_metrics(scoring)}
    return document, report, build_plots(document, losses, learning_rates), metrics
