"""Registry nodes: thin wrappers over :mod:`lychee_pipeline.registry` (settings typed by `RegistryParams`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from lychee_pipeline import registry
from lychee_pipeline.data.params import DataProcessingParams
from lychee_pipeline.evaluation.params import EvaluationParams, evaluation_params
from lychee_pipeline.evaluation.scoring import BASE, candidate_table, score_candidates
from lychee_pipeline.reranker.model import ModelConfig
from lychee_pipeline.training.config import TrainingParams
from lychee_pipeline.runtime.errors import typed, validated
from lychee_pipeline.registry import RegistryParams
from lychee_pipeline.training.stage import StageResult, as_stage_results

log = logging.getLogger(__name__)

#: Training settings that decide how pairs are processed (they travel with the model as version tags).
PROCESSING_KEYS = ("max_length", "min_pixels", "max_pixels", "resolution_schedule", "loss", "group_size")


def processing_settings(training: TrainingParams, evaluation: EvaluationParams,
                        data_processing: DataProcessingParams) -> dict[str, Any]:
    """Training's pair processing, the scoring options and the split settings (which test split)."""
    return {
        "training": training.model_dump(include=set(PROCESSING_KEYS)),
        "scoring": dict(evaluation.reranker),
        "instructions": evaluation.instructions,
        "split": data_processing.split.model_dump(),
    }


def register_final_model(
    test_records: Any,
    test_scores: pd.DataFrame,
    stage_results: Sequence[Mapping[str, Any]],
    mlflow_logging: Mapping[str, Any],
    model: Mapping[str, Any],
    data_counts: Mapping[str, Any],
    evaluation_mlflow_metrics: Mapping[str, float],
    evaluation: Mapping[str, Any],
    training: Mapping[str, Any],
    data_processing: Mapping[str, Any],
    params: Mapping[str, Any],
) -> tuple[dict[str, Any], str]:
    """Register the final stage's logged model; champion alias only if it wins the paired test."""
    outcome: dict[str, Any]
    settings = typed(RegistryParams, "registry", params)
    name = settings.model_name
    if not settings.enabled:
        outcome = {"status": "skipped", "name": name, "reason": "registry.enabled is false"}
    elif not mlflow_logging.get("model_uri"):
        reason = "no logged MLflow model"
        if mlflow_logging.get("failures"):
            reason += ": " + "; ".join(mlflow_logging["failures"])
        outcome = {"status": "skipped", "name": name, "reason": reason}
    else:
        try:
            outcome = _register(test_records, test_scores, as_stage_results(stage_results), mlflow_logging,
                                validated(ModelConfig, "model", dict(model)), data_counts, evaluation_mlflow_metrics,
                                evaluation_params(evaluation), validated(TrainingParams, "training", dict(training)),
                                typed(DataProcessingParams, "data_processing", data_processing), settings)
        except Exception as exc:  # noqa: BLE001 - the run's outputs are saved; the summary says what failed
            log.error("model registry step failed: %s: %s", type(exc).__name__, exc)
            outcome = {"status": "failed", "name": name, "reason": f"{type(exc).__name__}: {exc}"}
    if outcome["status"] != "registered":
        log.warning("registry: %s (%s)", outcome["status"], outcome["reason"])
    return outcome, registry.render_report(outcome)


def _register(test_records, test_scores, stage_results: list[StageResult], mlflow_logging, model: ModelConfig,
              data_counts, evaluation_mlflow_metrics, evaluation: EvaluationParams, training: TrainingParams,
              data_processing: DataProcessingParams, params: RegistryParams) -> dict[str, Any]:
    import mlflow

    final = stage_results[-1].stage
    new_scores = test_scores[test_scores["model"] == final].drop(columns="model")
    base_scores = test_scores[test_scores["model"] == BASE].drop(columns="model")
    if new_scores.empty:
        raise ValueError(f"test_scores hold no scores of the final stage {final!r}")
    seed = evaluation.seed
    query_ids = set(new_scores["query_id"].astype(str))

    def score_reference(uri: str) -> pd.DataFrame:
        queries = [q for q in candidate_table(test_records, seed) if q["query_id"] in query_ids]
        log.info("registry: scoring %s on the same %d test queries", uri, len(queries))
        table = score_candidates(queries, "champion", registry.load_scorer(uri))
        return table.drop(columns="model")

    active = mlflow.active_run()
    run_id = active.info.run_id if active is not None else None
    tags = {"base_model": model.name_or_path, "family": _family(model.name_or_path), "finetune": model.finetune,
            "data.train_sha256": _training_data_sha256(stage_results[-1]), "stage": final, "run_id": run_id}
    details = registry.run_details(
        evaluation_mlflow_metrics, data_counts, processing_settings(training, evaluation, data_processing),
        {"logged_model_uri": mlflow_logging["model_uri"]},
    )
    outcome = registry.register_and_gate(
        model_uri=mlflow_logging["model_uri"], name=params.model_name, new_scores=new_scores, base_scores=base_scores,
        score_reference=score_reference, tags=tags, details=details, gate=params.gate.model_dump(),
        alias=params.alias, seed=seed,
        n_resamples=evaluation.significance.n_resamples, confidence_level=evaluation.significance.confidence_level,
        run_id=run_id,
    )
    if active is not None:
        mlflow.set_tags({"registry.version": outcome["version"], "registry.promoted": outcome["promoted"],
                         "registry.reason": outcome["reason"][:5000]})
    return outcome


def _family(name_or_path: str) -> str | None:
    """The model family of the base model (`qwen2_5_vl`), from its config.json; None when it cannot be read."""
    from lychee_pipeline.reranker.families import family_of
    from lychee_pipeline.reranker.model import resolve_model_path

    try:
        return family_of(resolve_model_path(name_or_path, local_files_only=True), local_files_only=True
                         ).__name__.rsplit(".", 1)[-1]
    except Exception as exc:  # noqa: BLE001 - a tag left out, the version is still registered
        log.warning("registry: the model family of %s is unknown (%s: %s)", name_or_path, type(exc).__name__, exc)
        return None


def _training_data_sha256(result: StageResult) -> str | None:
    """sha256 of the training table the stage read (named in its spec.json); None when it is gone."""
    from lychee_pipeline.runtime.files import sha256_file
    from lychee_pipeline.training.stage import SPEC_FILE, StageSpec

    spec = Path(result.adapter_dir).parent / SPEC_FILE
    try:
        return sha256_file(Path(StageSpec.read(spec).data_path))
    except (OSError, ValueError) as exc:
        log.warning("registry: no training data hash for the version (%s: %s)", type(exc).__name__, exc)
        return None
