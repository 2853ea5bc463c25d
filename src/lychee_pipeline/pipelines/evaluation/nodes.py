"""Evaluation nodes: thin wrappers over :mod:`lychee_pipeline.evaluation` and the reranker's inference."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm
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
from lychee_pipeline.evaluation.metrics import query_rng

logger = logging.getLogger(__name__)

BASE = "base"
META_FIELDS = ("clicks", "purchased", "popularity")
SCORING_PROGRESS_EVERY_S = 20.0
SCORE_COLUMNS = ["model", "query_id", "doc_id", "label", "score", "position", "task_type", "language", *META_FIELDS]


# --------------------------------------------------------------------------- helpers


def _records(table: Any) -> list[dict[str, Any]]:
    """Rows of a pyarrow Table or pandas DataFrame as plain dicts."""
    if hasattr(table, "to_pylist"):
        return table.to_pylist()
    if isinstance(table, pd.DataFrame):
        return table.to_dict("records")
    return [dict(r) for r in table]


def _items(value: Any) -> list[Mapping[str, Any]]:
    if value is None:
        return []
    if isinstance(value, float) and math.isnan(value):
        return []
    return list(value)


def _meta(raw: Any) -> dict[str, Any]:
    if raw is None or raw == "":
        return {}
    if isinstance(raw, Mapping):
        return dict(raw)
    try:
        parsed = json.loads(raw)
    except (TypeError, ValueError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _number(value: Any) -> float:
    if isinstance(value, bool):
        return float(value)
    try:
        f = float(value)
    except (TypeError, ValueError):
        return float("nan")
    return f


def _item(value: Mapping[str, Any] | None) -> dict[str, Any]:
    value = value or {}
    return {"text": value.get("text"), "image": value.get("image")}


def stage_name(stage: Mapping[str, Any], index: int) -> str:
    """A stage result's name: ``stage``, else ``name``, else ``stage_<index>``."""
    return str(stage.get("stage") or stage.get("name") or f"stage_{index}")


def candidate_table(test_records: Any, seed: int = 0) -> list[dict[str, Any]]:
    """One entry per test query: its id, attributes, query item and shuffled candidates.

    Candidates are the record's positives (label 1) then negatives (label 0), deduplicated by
    ``doc_id`` (the first occurrence wins), then shuffled with the query's seeded generator.
    """
    out = []
    for record in _records(test_records):
        query_id = str(record["record_id"])
        seen: set[str] = set()
        candidates = []
        for label, docs in ((1, record.get("positives")), (0, record.get("negatives"))):
            for doc in _items(docs):
                doc_id = str(doc["doc_id"])
                if doc_id in seen:
                    logger.warning("query %s lists candidate %s twice; keeping the first", query_id, doc_id)
                    continue
                seen.add(doc_id)
                meta = _meta(doc.get("meta"))
                candidates.append({
                    "doc_id": doc_id,
                    "label": label,
                    "item": _item(doc),
                    **{f: _number(meta.get(f)) for f in META_FIELDS},
                })
        order = query_rng(seed, query_id).permutation(len(candidates))
        out.append({
            "query_id": query_id,
            "task_type": record.get("task_type"),
            "language": record.get("language"),
            "query": _item(record.get("query")),
            "candidates": [candidates[i] for i in order],
        })
    return out


def _load_reranker(name_or_path: str, adapter: str | None, options: Mapping[str, Any]) -> Any:
    from lychee_pipeline.reranker import Reranker

    if adapter is not None:  # a stage's saved folder (LoRA adapter or full weights) names its own base model
        return Reranker.from_pretrained(adapter, **dict(options))
    return Reranker.from_pretrained(name_or_path, **dict(options))


def score_candidates(queries: Sequence[Mapping[str, Any]], model: str, reranker: Any) -> pd.DataFrame:
    """Scores of one model on every query's candidates, as rows of the long scores table.

    All (query, candidate) pairs go to ``reranker.score_pairs`` at once, so the reranker can sort them
    by length and batch them across queries; it picks each pair's instruction from its task type.
    """
    pairs = [(q["query"], c["item"]) for q in queries for c in q["candidates"]]
    step = 256  # slices large enough for the reranker's length sorting, small enough for the progress to move
    values: list[float] = []
    bar = tqdm(range(0, len(pairs), step), desc=f"scoring with {model}", unit="slice", disable=None)
    started = last = time.monotonic()
    for start in bar:
        values.extend(reranker.score_pairs(pairs[start : start + step]))
        now = time.monotonic()
        if bar.disable and (now - last >= SCORING_PROGRESS_EVERY_S or len(values) == len(pairs)):
            # no bar when the output is a file: a line every SCORING_PROGRESS_EVERY_S seconds instead
            elapsed = now - started
            logger.info("scoring with %s: %d/%d pairs (%.0f%%) in %.0f s, ETA %.0f s", model, len(values),
                        len(pairs), 100 * len(values) / max(1, len(pairs)), elapsed,
                        elapsed / max(1, len(values)) * (len(pairs) - len(values)))
            last = now
    if len(values) != len(pairs):
        raise RuntimeError(f"{model}: {len(values)} scores for {len(pairs)} pairs")
    rows, it = [], iter(values)
    for q in queries:
        for position, cand in enumerate(q["candidates"]):
            rows.append({
                "model": model, "query_id": q["query_id"], "doc_id": cand["doc_id"], "label": cand["label"],
                "score": float(next(it)), "position": position, "task_type": q["task_type"],
                "language": q["language"], **{f: cand[f] for f in META_FIELDS},
            })
    return pd.DataFrame(rows, columns=SCORE_COLUMNS)


def models_to_score(stage_results: Iterable[Mapping[str, Any]] | None, model: Mapping[str, Any]) -> list[tuple[str, str, str | None]]:
    """``[(model name, name_or_path, adapter dir)]``: the base model, then each stage's adapter."""
    name_or_path = str(model["name_or_path"])
    out = [(BASE, name_or_path, model.get("adapter") or None)]
    for i, stage in enumerate(stage_results or []):
        adapter = stage.get("adapter_dir") or stage.get("adapter")
        if not adapter:
            raise ValueError(f"stage result {stage_name(stage, i)!r} has no 'adapter_dir'")
        out.append((stage_name(stage, i), str(stage.get("name_or_path") or name_or_path), str(adapter)))
    return out


# --------------------------------------------------------------------------- nodes


def score_test_set(
    test_records: Any,
    stage_results: Sequence[Mapping[str, Any]] | None,
    model: Mapping[str, Any],
    evaluation: Mapping[str, Any],
) -> pd.DataFrame:
    """Score every test query's shuffled candidates with the base model and each stage's adapter.

    Returns the long scores table (columns :data:`SCORE_COLUMNS`), ``model`` being ``"base"`` or the
    stage name.
    """
    seed = int(evaluation.get("seed", 0))
    queries = candidate_table(test_records, seed)
    if evaluation.get("max_queries"):  # a deterministic slice (the smoke run's "small test slice")
        queries = queries[: int(evaluation["max_queries"])]
    options = dict(evaluation.get("reranker") or {})
    if evaluation.get("instructions"):
        options["instructions"] = evaluation["instructions"]
    tables = []
    for name, name_or_path, adapter in models_to_score(stage_results, model):
        logger.info("scoring %d test queries with %s (%s, adapter %s)", len(queries), name, name_or_path, adapter)
        reranker = _load_reranker(name_or_path, adapter, options)
        tables.append(score_candidates(queries, name, reranker))
        del reranker
    return pd.concat(tables, ignore_index=True)


def _model_tables(scores: pd.DataFrame) -> dict[str, pd.DataFrame]:
    return {str(name): group.drop(columns="model") for name, group in scores.groupby("model", sort=False)}


def compute_ranking_metrics(scores: pd.DataFrame, evaluation: Mapping[str, Any]) -> dict[str, Any]:
    """MRR@10, NDCG@10, Recall@1/5/10, MAP per model, by task type and language, and vs base."""
    sig = evaluation.get("significance") or {}
    return _jsonable(evaluate_models(
        _model_tables(scores),
        base=BASE,
        seed=int(evaluation.get("seed", 0)),
        n_resamples=int(sig.get("n_resamples", 10_000)),
        confidence_level=float(sig.get("confidence_level", 0.95)),
    ))


def compute_business_metrics(scores: pd.DataFrame, evaluation: Mapping[str, Any]) -> dict[str, Any]:
    """Expected CTR, clicks and purchases, long-tail share and coverage at each k, vs base."""
    seed = int(evaluation.get("seed", 0))
    cfg = evaluation.get("business") or {}
    ranked = {name: rank_candidates(table, seed) for name, table in _model_tables(scores).items()}
    return _jsonable(compare_business(
        ranked,
        base=BASE,
        ks=[int(k) for k in cfg.get("ks", [10])],
        examination=cfg.get("examination", "log2"),
        tail_fraction=float(cfg.get("tail_fraction", 0.8)),
    ))


def _full_train_pairs(stage_results: Sequence[Mapping[str, Any]], evaluation: Mapping[str, Any]) -> tuple[int | None, str]:
    configured = (evaluation.get("scaling") or {}).get("full_train_pairs")
    if configured:
        return int(configured), "parameter evaluation.scaling.full_train_pairs"
    for stage in stage_results:
        if stage.get("full_train_pairs"):
            return int(stage["full_train_pairs"]), "stage results (full_train_pairs)"
    if stage_results:
        return max(int(s["train_pairs"]) for s in stage_results), "largest stage's train_pairs (assumed one epoch)"
    return None, "none"


def compute_scaling_report(
    stage_results: Sequence[Mapping[str, Any]] | None,
    ranking_metrics: Mapping[str, Any],
    evaluation: Mapping[str, Any],
) -> dict[str, Any]:
    """The scaling table over the stages; each stage's MRR@10 is taken from the test metrics."""
    stages = []
    for i, stage in enumerate(stage_results or []):
        name = stage_name(stage, i)
        figures = (ranking_metrics.get("models") or {}).get(name)
        stage = {**stage, "stage": name}
        if stage.get("mrr_at_10") is None and figures:
            stage["mrr_at_10"] = figures["overall"]["mrr_at_10"]
        stages.append(stage)
    full, source = _full_train_pairs(stages, evaluation)
    report = scaling_report(stages, full)
    report["full_train_pairs_source"] = source
    return _jsonable(report)


def build_report(
    ranking_metrics: Mapping[str, Any],
    business_metrics: Mapping[str, Any],
    scaling: Mapping[str, Any],
    stage_results: Sequence[Mapping[str, Any]] | None,
) -> tuple[dict[str, Any], str, dict[str, Any], dict[str, float]]:
    """The metrics document, the Markdown report, the plots ``{file name: Figure}`` and MLflow metrics."""
    losses = {stage_name(s, i): s.get("losses") or [] for i, s in enumerate(stage_results or [])}
    learning_rates = {stage_name(s, i): s.get("learning_rates") or [] for i, s in enumerate(stage_results or [])}
    document = _jsonable(build_metrics_document(ranking_metrics, business_metrics, scaling, losses))
    return document, render_markdown(document), build_plots(document, losses, learning_rates), mlflow_metrics(document)


def _jsonable(value: Any) -> Any:
    """Plain JSON types; NaN and infinities become ``None``."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        f = float(value)
        return f if math.isfinite(f) else None
    return value
