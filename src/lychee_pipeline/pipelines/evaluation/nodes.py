"""Evaluation nodes: thin wrappers over :mod:`lychee_pipeline.evaluation` and the reranker's inference."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
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
from lychee_pipeline.evaluation.params import EvaluationParams, evaluation_params
from lychee_pipeline.evaluation.score_cache import (
    ScoreCache,
    cache_key,
    model_identity,
    pairs_hash,
    processing_settings,
)
from lychee_pipeline.evaluation.scoring_report import add_scoring, scoring_mlflow_metrics
from lychee_pipeline.evaluation.score_shards import read_scores, score_pairs_in_slices, write_pairs
from lychee_pipeline.evaluation.scaling import ScalingReport
from lychee_pipeline.reranker.model import ModelConfig
from lychee_pipeline.reranker.prompt import instruction_for
from lychee_pipeline.training.config import TrainingParams
from lychee_pipeline.training.stage import StageResult, as_stage_results

logger = logging.getLogger(__name__)

BASE = "base"
META_FIELDS = ("clicks", "purchased", "popularity")
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


def score_rows(queries: Sequence[Mapping[str, Any]], model: str, values: Sequence[float]) -> pd.DataFrame:
    """The long scores table of one model from its scores in pair order (query by query, candidate by candidate)."""
    n_pairs = sum(len(q["candidates"]) for q in queries)
    if len(values) != n_pairs:
        raise RuntimeError(f"{model}: {len(values)} scores for {n_pairs} pairs")
    rows, it = [], iter(values)
    for q in queries:
        for position, cand in enumerate(q["candidates"]):
            rows.append({
                "model": model, "query_id": q["query_id"], "doc_id": cand["doc_id"], "label": cand["label"],
                "score": float(next(it)), "position": position, "task_type": q["task_type"],
                "language": q["language"], **{f: cand[f] for f in META_FIELDS},
            })
    return pd.DataFrame(rows, columns=SCORE_COLUMNS)


def query_pairs(queries: Sequence[Mapping[str, Any]],
                instructions: Mapping[str, str] | None = None) -> list[tuple[dict, dict, str | None]]:
    """Every (query item, candidate item, instruction) triple, query by query.

    The instruction follows the query's task type, as in training, where a record's task type sets the
    instruction of every document of its group; None (no task type) lets the reranker derive it per pair.
    """
    return [(q["query"], c["item"], instruction_for(q["task_type"], instructions) if q.get("task_type") else None)
            for q in queries for c in q["candidates"]]


def score_candidates(queries: Sequence[Mapping[str, Any]], model: str, reranker: Any) -> pd.DataFrame:
    """Scores of one model on every query's candidates, as rows of the long scores table.

    All (query, candidate) pairs go to ``reranker.score_pairs`` in large slices, so the reranker can sort
    them by length and batch them across queries; each pair carries its query's instruction (query_pairs).
    """
    pairs = query_pairs(queries, reranker.processing.instructions)
    return score_rows(queries, model, score_pairs_in_slices(reranker, pairs, f"scoring with {model}"))


def sample_queries(queries: Sequence[Mapping[str, Any]], k: int | None, seed: int) -> list[Mapping[str, Any]]:
    """A fixed seeded sample of ``k`` queries, in their original order (all of them when k is None or >= n)."""
    if not k or k >= len(queries):
        return list(queries)
    chosen = np.sort(np.random.default_rng([seed, 0x5A3D]).choice(len(queries), size=int(k), replace=False))
    return [queries[int(i)] for i in chosen]


def stage_processing(adapter: str | None, training: TrainingParams) -> dict[str, Any]:
    """The processing settings a model was trained with: those saved with its adapter (the stage's last pixel
    budget included), else its stage's spec.json, else the training parameters."""
    from lychee_pipeline.reranker.model import processing_of

    trained = processing_of(adapter) if adapter else None
    if trained is not None:
        return {k: v for k, v in trained.as_dict().items() if k != "instructions" and v is not None}
    source = training
    if adapter:
        spec_path = Path(adapter).parent / "spec.json"
        if spec_path.is_file():
            from lychee_pipeline.training.stage import StageSpec

            try:
                source = StageSpec.read(spec_path).training
            except ValueError:  # unreadable, or a spec from before the typed contract: the training parameters
                pass
    return {"max_length": source.max_length, "min_pixels": source.min_pixels, "max_pixels": source.max_pixels}


def models_to_score(stage_results: Iterable[StageResult | Mapping[str, Any]] | None,
                    model: ModelConfig | Mapping[str, Any]) -> list[tuple[str, str, str | None]]:
    """``[(model name, name_or_path, adapter dir)]``: the base model, then each stage's adapter (whose folder
    names its own base model; ``name_or_path`` is the configured one)."""
    from lychee_pipeline.training.planning import validated

    config = model if isinstance(model, ModelConfig) else validated(ModelConfig, "model", dict(model))
    name_or_path = config.name_or_path
    return [(BASE, name_or_path, config.adapter or None)] + [
        (result.stage, name_or_path, result.adapter_dir) for result in as_stage_results(stage_results)]


# --------------------------------------------------------------------------- nodes


def score_test_set(
    test_records: Any,
    stage_results: Sequence[Mapping[str, Any]] | None,
    model: Mapping[str, Any],
    evaluation: Mapping[str, Any],
    gpus: int = 1,
    device: str = "auto",
    training: Any = None,  # params:training (a dict, or TrainingParams); a Union hint here would make Kedro warn
) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Score every test query's shuffled candidates with the base model and each stage's adapter.

    - Each model is scored with its processing settings (``max_length``, ``min/max_pixels`` of its stage's
      spec, else ``training``), overridden by ``evaluation.reranker``.
    - A check stage (a result with ``final: false``) is scored on a fixed seeded sample of
      ``evaluation.check_stage_queries`` test queries; the base model and the final stage on all of them.
    - The base model's scores are reused from the score cache (``evaluation.score_cache``) when the model,
      the processing settings and the scored pairs are unchanged.
    - With ``evaluation.scoring.processes`` (default ``gpus``) above 1, the models left to score run in one
      ``accelerate launch`` of that many processes (GPUs, or CPU processes without CUDA), each scoring a
      shard (:mod:`lychee_pipeline.evaluation.score_shards`); otherwise in this process.

    Returns the long scores table (columns :data:`SCORE_COLUMNS`, ``model`` being ``"base"`` or the stage
    name) and the scoring figures ``{"models": {name: {...}}, "processes", "device_type"}``.
    """
    from lychee_pipeline.training.launch import resolve_device
    from lychee_pipeline.training.planning import validated

    results, params = as_stage_results(stage_results), evaluation_params(evaluation)
    if not isinstance(training, TrainingParams):
        training = validated(TrainingParams, "training", dict(training or {}))
    seed = params.seed
    queries = candidate_table(test_records, seed)
    if params.max_queries:  # a deterministic slice (the smoke run's "small test slice")
        queries = queries[: params.max_queries]
    sample = sample_queries(queries, params.check_stage_queries, seed)
    processes = int(params.scoring.processes or gpus or 1)
    reranker_options = dict(params.reranker)
    if params.instructions:
        reranker_options["instructions"] = params.instructions
    device_type = resolve_device(str(reranker_options.get("device") or device or "auto"))
    cache = ScoreCache(params.score_cache.dir) if params.score_cache.enabled else None
    work_dir = Path(params.scoring.work_dir)

    models = models_to_score(results, model)
    finals = [True] + [result.final for result in results]
    final_processing = stage_processing(models[-1][2] if len(models) > 1 else None, training)
    instructions = params.instructions
    pair_sets = {"all": query_pairs(queries, instructions),
                 "sample": query_pairs(sample, instructions) if len(sample) < len(queries) else None}
    plan, figures, values = [], {}, {}
    for (name, name_or_path, adapter), final in zip(models, finals):
        which = "all" if final or pair_sets["sample"] is None else "sample"
        own = stage_processing(adapter, training) if adapter and name != BASE else final_processing
        options = {**own, **{k: v for k, v in reranker_options.items()}}
        chosen = queries if which == "all" else sample
        figures[name] = {"queries": len(chosen), "test_queries": len(queries), "sampled": which == "sample",
                         "pairs": len(pair_sets[which]), "reused": False, "cache_key": None}
        if name == BASE and cache is not None:
            key, parts = cache_key(model_identity(name_or_path, adapter), processing_settings(options, device_type),
                                   pairs_hash(pair_sets[which]))
            figures[name]["cache_key"] = key
            found = cache.lookup(key, len(pair_sets[which]))
            if found is not None:
                logger.info("base model: reusing cached scores %s (same model, processing settings and test pairs)",
                            cache.paths(key)[0])
                values[name] = found
                figures[name].update(reused=True, seconds=0.0, pairs_per_s=None, processes=0)
                continue
            figures[name]["_cache"] = (key, parts)
        plan.append((name, name_or_path, adapter, options, which))

    if plan and processes > 1:
        _score_launched(plan, pair_sets, processes, device_type, training, work_dir, figures, values)
    else:
        for name, name_or_path, adapter, options, which in plan:
            started = time.perf_counter()
            logger.info("scoring %d pairs with %s (%s, adapter %s) in this process", len(pair_sets[which]), name,
                        name_or_path, adapter)
            reranker = _load_reranker(name_or_path, adapter, options)
            loaded = time.perf_counter()
            values[name] = score_pairs_in_slices(reranker, pair_sets[which], f"scoring with {name}")
            del reranker
            done = time.perf_counter()
            figures[name].update(seconds=done - started, processes=1, device=device_type,
                                 pairs_per_s=len(pair_sets[which]) / (done - loaded) if done > loaded else None)
    for name, entry in figures.items():
        if "_cache" in entry:
            key, parts = entry.pop("_cache")
            cache.store(key, parts, values[name], {k: entry.get(k) for k in ("seconds", "pairs_per_s", "processes")})
    tables = [score_rows(queries if not figures[name]["sampled"] else sample, name, values[name])
              for name, _, _ in models]
    return pd.concat(tables, ignore_index=True), _jsonable({
        "models": figures, "processes": processes, "device_type": device_type,
        "check_stage_queries": len(sample), "seed": seed,
    })


def _score_launched(plan, pair_sets, processes, device_type, training: TrainingParams, work_dir, figures,
                    values) -> None:
    """One `accelerate launch` of `processes` processes scoring every model of `plan` (see score_shards)."""
    from lychee_pipeline.training.launch import StageFailed, check_device_count, run_stage

    check_device_count(processes, device_type)
    work_dir.mkdir(parents=True, exist_ok=True)
    paths = {which: write_pairs(pairs, work_dir / f"pairs_{which}.parquet")
             for which, pairs in pair_sets.items() if pairs is not None and any(p[4] == which for p in plan)}
    jobs = [{"name": name, "name_or_path": name_or_path, "adapter": adapter,
             "options": {k: v for k, v in options.items() if k != "device"},
             "pairs_path": str(paths[which].resolve()), "scores_path": str((work_dir / f"scores_{_safe(name)}.parquet").resolve())}
            for name, name_or_path, adapter, options, which in plan]
    # the model's own dtype decides; no autocast on top of it
    launch = training.launch.model_copy(update={"mixed_precision": "no"}).model_dump()
    spec = {"stage": "scoring", "output_dir": str(work_dir.resolve()), "jobs": jobs, "training": {"launch": launch}}
    logger.info("scoring %s on %d %s processes", ", ".join(j["name"] for j in jobs), processes, device_type.upper())
    try:
        result = run_stage(work_dir, spec, processes, device_type, None, {},
                           module="lychee_pipeline.evaluation.score_shards")
    except StageFailed as exc:
        raise StageFailed(f"test-set scoring on {processes} {device_type} processes failed "
                          f"(work folder {work_dir}): {exc}") from exc
    for job, done in zip(jobs, result["jobs"], strict=True):
        values[job["name"]] = read_scores(done["scores_path"])
        figures[job["name"]].update({k: done[k] for k in ("seconds", "pairs_per_s", "processes", "device",
                                                          "load_seconds", "scoring_seconds")})


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _model_tables(scores: pd.DataFrame) -> dict[str, pd.DataFrame]:
    return {str(name): group.drop(columns="model") for name, group in scores.groupby("model", sort=False)}


def compute_ranking_metrics(scores: pd.DataFrame, evaluation: Mapping[str, Any]) -> dict[str, Any]:
    """MRR@10, NDCG@10, Recall@1/5/10, MAP per model, by task type and language, and vs base."""
    params = evaluation_params(evaluation)
    return _jsonable(evaluate_models(
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
    return _jsonable(compare_business(
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
    return _jsonable(report.model_dump())


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
    document = _jsonable(build_metrics_document(ranking_metrics, business_metrics, typed_scaling, losses))
    if scoring:
        document["scoring"] = _jsonable(scoring)
    report = add_scoring(render_markdown(document), scoring)
    metrics = {**mlflow_metrics(document), **scoring_mlflow_metrics(scoring)}
    return document, report, build_plots(document, losses, learning_rates), metrics


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
