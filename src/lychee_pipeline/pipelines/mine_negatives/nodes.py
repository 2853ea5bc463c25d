"""Thin nodes over :mod:`lychee_pipeline.mining`: mine the training table, or pass it through when off."""

from __future__ import annotations

import logging
from typing import Any

import pyarrow as pa

from lychee_pipeline.mining import LOG_SCHEMA, MiningParams, mine_table, model_key, score_histogram
from lychee_pipeline.runtime.errors import typed

log = logging.getLogger(__name__)


def _reranker_factory(name: str, adapter: str | None, options: dict[str, Any]):
    def load():
        from lychee_pipeline.reranker.inference import Reranker

        log.info("mining: loading %s%s to rescore candidates", name, f" + adapter {adapter}" if adapter else "")
        return Reranker.from_pretrained(name, adapter=adapter, **options)

    return load


def _log_to_mlflow(counts: dict[str, Any]) -> None:
    try:
        import mlflow
    except ImportError:
        return
    if mlflow.active_run() is None:
        return
    metrics = {f"mining.{k}": float(v) for k, v in counts.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    try:
        mlflow.log_metrics(metrics)
    except Exception as exc:  # noqa: BLE001 - tracking is best effort; the counts are saved as a dataset too
        log.error("mining: MLflow logging failed (counts are in data/08_reporting/): %s: %s", type(exc).__name__, exc)


def _mine(records: pa.Table, params: MiningParams, model: dict[str, Any], enabled: bool):
    if not enabled:
        log.info("mining: off, the %d training records pass through unchanged", records.num_rows)
        counts = {"enabled": False, "queries": records.num_rows}
        return records, counts, LOG_SCHEMA.empty_table(), score_histogram({})
    name = params.model or model["name_or_path"]
    options = dict(params.reranker)
    result = mine_table(records, params, _reranker_factory(name, params.adapter, options),
                        model_key(name, params.adapter, options, params.instruction))
    counts = {"enabled": True, "model": name, "adapter": params.adapter, **result.counts}
    _log_to_mlflow(counts)
    return result.table, counts, result.log_table, score_histogram(result.scores)


def mine_train_negatives(train_records: pa.Table, mining: dict[str, Any], model: dict[str, Any]):
    """Mine negatives for the train split (``mining.enabled``)."""
    params = typed(MiningParams, "mining", mining)
    return _mine(train_records, params, model, params.enabled)


def mine_smoke_negatives(smoke_train_records: pa.Table, mining: dict[str, Any], model: dict[str, Any]):
    """Mine negatives for the smoke subset of the train split (``mining.smoke_enabled``)."""
    params = typed(MiningParams, "mining", mining)
    return _mine(smoke_train_records, params, model, params.smoke_enabled)
