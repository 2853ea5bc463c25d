"""Reporting nodes: what a run ends with — MLflow metrics and model, and a short summary in the log."""

from __future__ import annotations

import logging
from typing import Any

from lychee_pipeline.evaluation.params import evaluation_params
from lychee_pipeline.evaluation.report import stage_run_metrics
from lychee_pipeline.evaluation.scaling import ScalingReport
from lychee_pipeline.registry import ServingParams
from lychee_pipeline.reranker.model import ModelConfig
from lychee_pipeline.runtime.errors import typed, validated
from lychee_pipeline.training.stage import as_stage_results

log = logging.getLogger(__name__)


def _numeric(metrics: dict[str, Any], prefix: str) -> dict[str, float]:
    return {f"{prefix}.{k}": float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def serving_config(raw_source: dict[str, Any], evaluation: dict[str, Any],
                   serving: dict[str, Any] | None) -> dict[str, Any]:
    """What the logged MLflow model scores with besides its weights (see ``mlflow_model.py``).

    The evaluation's reranker options and instructions (so served scores equal the evaluation's), and
    the image roots requests are confined to: ``serving.image_roots``, else the run's data image roots.
    """
    roots = typed(ServingParams, "serving", serving).image_roots or list(raw_source.get("image_roots") or [])
    evaluation = evaluation_params(evaluation)
    return {
        "reranker": dict(evaluation.reranker),
        "instructions": evaluation.instructions or None,
        "image_roots": roots,
    }


def log_run_to_mlflow(
    evaluation_mlflow_metrics: dict[str, float], data_counts: dict[str, Any], stage_results: list[dict], model: dict,
    serving_config: dict[str, Any] | None = None, scaling_report: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Log data counts and evaluation metrics on the parent run, per-stage figures on the stage runs, and the model.

    Each stage's nested run gets its own training figures (``scaling.<field>`` from its row of
    ``scaling_report``, ``training.final_loss``); test and business metrics stay on the parent run only, one
    place for them. ``serving_config`` (scoring options, image roots) goes into the logged model's
    ``reranker.json``."""
    results, base_model = as_stage_results(stage_results), validated(ModelConfig, "model", dict(model))
    scaling = ScalingReport.model_validate(scaling_report) if scaling_report is not None else None
    logged: dict[str, Any] = {"metrics": 0, "model_uri": None, "failures": []}
    try:
        import mlflow
    except ImportError:
        return logged
    if mlflow.active_run() is None:
        return logged
    metrics = {**_numeric(data_counts, "data"), **{k: float(v) for k, v in evaluation_mlflow_metrics.items()}}
    try:
        mlflow.log_metrics(metrics)
        logged["metrics"] = len(metrics)
        client = mlflow.MlflowClient()
        for result in results:
            if result.mlflow_run_id:
                row = scaling.row(result.stage) if scaling is not None else None
                for key, value in stage_run_metrics(row, result.stage, result.losses).items():
                    client.log_metric(result.mlflow_run_id, key, value)
        if results:
            from lychee_pipeline.tracking import log_reranker_model

            logged["model_uri"] = log_reranker_model(results[-1].adapter_dir, base_model.name_or_path,
                                                     serving=serving_config)
    except Exception as exc:  # noqa: BLE001 - a tracking failure is reported, the run's files are already saved
        log.error("MLflow logging failed (outputs are saved under data/): %s: %s", type(exc).__name__, exc)
        logged["failures"].append(f"{type(exc).__name__}: {exc}")
    return logged


def summarize_run(data_counts: dict[str, Any], stage_results: list[dict], evaluation_mlflow_metrics: dict[str, float],
                  mlflow_logging: dict[str, Any], registry_outcome: dict[str, Any] | None = None) -> dict[str, Any]:
    """One closing summary: lines and records in and out, stages, MRR@10 base -> fine-tuned, where the report is,
    and (in `full`) what the model registry did.

    The counts are `data_counts`' own, under the names it gives them: ``lines_in`` lines read, of which
    ``rejected`` and ``duplicates`` are left out, so ``records_in`` (the records ingested, ``data_counts``'
    ``records_in`` and ``clean``) ``== lines_in - rejected - duplicates``; ``records_in == records_normalized +
    quarantined``; ``records_normalized`` split into ``train_records``, ``val_records`` and ``test_records``."""
    results = as_stage_results(stage_results)
    mrr = {m: evaluation_mlflow_metrics.get(f"test.mrr_at_10.{m}") for m in ("base", "finetuned")}
    summary = {
        "lines_in": data_counts.get("lines_in"),
        "rejected": data_counts.get("rejected"),
        "duplicates": data_counts.get("duplicates"),
        "records_in": data_counts.get("records_in", data_counts.get("clean")),
        "records_normalized": data_counts.get("normalized"),
        "quarantined": data_counts.get("quarantined"),
        "train_records": data_counts.get("train_size"),
        "val_records": data_counts.get("val_size"),
        "test_records": data_counts.get("test_size"),
        "stages": [f"{r.stage}: {r.steps} steps, {r.pairs_per_s:.1f} pairs/s" for r in results],
        "mrr_at_10_base": mrr.get("base"),
        "mrr_at_10_finetuned": mrr.get("finetuned"),
        "report": "data/08_reporting/evaluation_report.md",
        "mlflow_model_uri": mlflow_logging.get("model_uri"),
    }
    registry_text = ""
    if registry_outcome is not None:
        from lychee_pipeline.registry import summary_line

        summary["registry"] = {k: registry_outcome.get(k) for k in (
            "status", "name", "version", "model_uri", "alias", "promoted", "champion_version", "reference", "reason")}
        summary["registry_report"] = "data/08_reporting/registry_report.md"
        registry_text = f"; registry: {summary_line(registry_outcome)}"
    log.info(
        "run summary: %s lines in -> %s records (%s rejected, %s duplicate) -> %s normalized (%s quarantined) -> "
        "train %s, val %s, test %s; stages: %s; MRR@10 base %s -> fine-tuned %s; report: %s%s",
        summary["lines_in"], summary["records_in"], summary["rejected"], summary["duplicates"],
        summary["records_normalized"], summary["quarantined"], summary["train_records"], summary["val_records"],
        summary["test_records"],
        "; ".join(summary["stages"]), _fmt(summary["mrr_at_10_base"]), _fmt(summary["mrr_at_10_finetuned"]),
        summary["report"], registry_text,
    )
    return summary


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)
