"""Reporting nodes: what a run ends with — MLflow metrics and model, and a short summary in the log."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def _numeric(metrics: dict[str, Any], prefix: str) -> dict[str, float]:
    return {f"{prefix}.{k}": float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


STAGE_RUN_PREFIXES = ("scaling", "training")


def stage_training_metrics(evaluation_mlflow_metrics: dict[str, float], stage: str) -> dict[str, float]:
    """`scaling.<stage>.pairs_per_s` -> `scaling.pairs_per_s`, ...: a stage run's training figures only."""
    out = {}
    for key, value in evaluation_mlflow_metrics.items():
        parts = key.split(".")
        if parts[0] in STAGE_RUN_PREFIXES and stage in parts and parts[-1] != "mrr_at_10":  # test figure: parent
            parts.remove(stage)
            out[".".join(parts)] = float(value)
    return out


def log_run_to_mlflow(
    evaluation_mlflow_metrics: dict[str, float], data_counts: dict[str, Any], stage_results: list[dict], model: dict,
    serving_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Log data counts and evaluation metrics on the parent run, per-stage figures on the stage runs, and the model.

    ``serving_config`` (scoring options, image roots) goes into the logged model's ``reranker.json``."""
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
        for result in stage_results:  # the stage's own training figures on its nested run (scaling.<stage>.*,
            # training.<stage>.*); test and business metrics stay on the parent run only, one place for them
            if result.get("mlflow_run_id"):
                for key, value in stage_training_metrics(evaluation_mlflow_metrics, result["stage"]).items():
                    client.log_metric(result["mlflow_run_id"], key, value)
        final = stage_results[-1] if stage_results else None
        if final is not None:
            from lychee_pipeline.tracking import log_reranker_model

            logged["model_uri"] = log_reranker_model(final["adapter_dir"], model["name_or_path"], serving=serving_config)
    except Exception as exc:  # noqa: BLE001 - a tracking failure is reported, the run's files are already saved
        log.error("MLflow logging failed (outputs are saved under data/): %s: %s", type(exc).__name__, exc)
        logged["failures"].append(f"{type(exc).__name__}: {exc}")
    return logged


def summarize_run(data_counts: dict[str, Any], stage_results: list[dict], evaluation_mlflow_metrics: dict[str, float],
                  mlflow_logging: dict[str, Any], registry_outcome: dict[str, Any] | None = None) -> dict[str, Any]:
    """One closing summary: records in and out, stages, MRR@10 base -> fine-tuned, where the report is, and
    (in `full`) what the model registry did."""
    mrr = {m: evaluation_mlflow_metrics.get(f"test.mrr_at_10.{m}") for m in ("base", "finetuned")}
    summary = {
        "records_in": data_counts.get("lines_in"),
        "records_clean": data_counts.get("clean"),
        "rejected": data_counts.get("rejected"),
        "quarantined": data_counts.get("quarantined"),
        "train_records": data_counts.get("train_size"),
        "test_records": data_counts.get("test_size"),
        "stages": [f"{r['stage']}: {r['steps']} steps, {r['pairs_per_s']:.1f} pairs/s" for r in stage_results],
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
        "run summary: %s lines in -> %s clean (%s rejected, %s quarantined); stages: %s; MRR@10 base %s -> fine-tuned %s;"
        " report: %s%s",
        summary["records_in"], summary["records_clean"], summary["rejected"], summary["quarantined"],
        "; ".join(summary["stages"]), _fmt(summary["mrr_at_10_base"]), _fmt(summary["mrr_at_10_finetuned"]),
        summary["report"], registry_text,
    )
    return summary


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)
