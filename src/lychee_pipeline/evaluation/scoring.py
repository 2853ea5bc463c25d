"""Scoring the test set with the base model and each stage's adapter, Kedro-free.

Each model is a typed `ModelToScore` (source, adapter, processing settings, which queries). The test records
become a candidate table (every query's shuffled candidates); check stages are scored on a seeded sample of
queries; the base model's scores come from the score cache when the model, the processing settings and the
pairs are unchanged; the models left are scored in this process, or in one `accelerate launch` of several
processes (a runtime `LaunchJob` running `score_shards` with its own `ScoringJobSpec`).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from lychee_pipeline.data.split import refuse_an_empty_test_split
from lychee_pipeline.evaluation.metrics import query_rng
from lychee_pipeline.evaluation.params import EvaluationParams
from lychee_pipeline.evaluation.score_cache import (
    ScoreCache,
    cache_key,
    model_identity,
    pairs_hash,
    processing_settings,
)
from lychee_pipeline.evaluation.score_shards import (
    ScoringJob,
    ScoringJobSpec,
    read_scores,
    score_pairs_in_slices,
    write_pairs,
)
from lychee_pipeline.reranker.model import ModelConfig, family_of_config
from lychee_pipeline.reranker.prompt import instruction_for
from lychee_pipeline.runtime.errors import validated
from lychee_pipeline.runtime.launcher import LaunchJob, StageFailed, check_device_count, launch, resolve_device
from lychee_pipeline.runtime.settings import LaunchParams
from lychee_pipeline.training.config import TrainingParams
from lychee_pipeline.training.stage import StageResult, StageSpec, as_stage_results

logger = logging.getLogger(__name__)

BASE = "base"
META_FIELDS = ("clicks", "purchased", "popularity")
SCORE_COLUMNS = ["model", "query_id", "doc_id", "label", "score", "position", "task_type", "language", *META_FIELDS]
SCORING_MODULE = "lychee_pipeline.evaluation.score_shards"


# --------------------------------------------------------------------------- the candidate table


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


def query_pairs(queries: Sequence[Mapping[str, Any]], instructions: Mapping[str, str] | None = None,
                defaults: Mapping[str, str] | None = None) -> list[tuple[dict, dict, str | None]]:
    """Every (query item, candidate item, instruction) triple, query by query (``defaults``: the model family's
    default instructions, Lychee-rerank-mm's when None).

    The instruction follows the query's task type, as in training, where a record's task type sets the
    instruction of every document of its group; None (no task type) lets the reranker derive it per pair.
    """
    return [(q["query"], c["item"], instruction_for(q["task_type"], instructions, defaults) if q.get("task_type") else None)
            for q in queries for c in q["candidates"]]


def score_candidates(queries: Sequence[Mapping[str, Any]], model: str, reranker: Any) -> pd.DataFrame:
    """Scores of one model on every query's candidates, as rows of the long scores table.

    All (query, candidate) pairs go to ``reranker.score_pairs`` in large slices, so the reranker can sort
    them by length and batch them across queries; each pair carries its query's instruction (query_pairs).
    """
    pairs = query_pairs(queries, reranker.processing.instructions, reranker.collator.family_module.DEFAULT_INSTRUCTIONS)
    return score_rows(queries, model, score_pairs_in_slices(reranker, pairs, f"scoring with {model}"))


def sample_queries(queries: Sequence[Mapping[str, Any]], k: int | None, seed: int) -> list[Mapping[str, Any]]:
    """A fixed seeded sample of ``k`` queries, in their original order (all of them when k is None or >= n)."""
    if not k or k >= len(queries):
        return list(queries)
    chosen = np.sort(np.random.default_rng([seed, 0x5A3D]).choice(len(queries), size=int(k), replace=False))
    return [queries[int(i)] for i in chosen]


# --------------------------------------------------------------------------- the models to score


@dataclass(frozen=True)
class ModelToScore:
    """One model to score: its source (the configured name or path), its adapter (a stage's saved folder,
    which names its own base model; None for the base model), the processing settings and reranker options it
    is loaded with, and whether it is scored on every test query (base, final stage) or on the sample."""

    name: str
    source: str
    adapter: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    all_queries: bool = True


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
            try:
                source = StageSpec.read(spec_path).training
            except ValueError:  # unreadable, or a spec from before the typed contract: the training parameters
                pass
    return {"max_length": source.max_length, "min_pixels": source.min_pixels, "max_pixels": source.max_pixels}


def models_to_score(stage_results: Iterable[StageResult | Mapping[str, Any]] | None,
                    model: ModelConfig | Mapping[str, Any], training: TrainingParams | None = None,
                    reranker_options: Mapping[str, Any] | None = None) -> list[ModelToScore]:
    """The base model, then each stage's adapter, each with its processing settings (its own for a stage; the
    final stage's for the base model, so both see the same pixels) overridden by ``reranker_options``."""
    config = validated(ModelConfig, "model", model if isinstance(model, ModelConfig) else dict(model))
    training = training or TrainingParams()
    results = as_stage_results(stage_results)
    final_processing = stage_processing(results[-1].adapter_dir if results else None, training)
    overrides = dict(reranker_options or {})
    base = ModelToScore(BASE, config.name_or_path, config.adapter or None, {**final_processing, **overrides})
    return [base] + [
        ModelToScore(result.stage, config.name_or_path, result.adapter_dir,
                     {**stage_processing(result.adapter_dir, training), **overrides}, all_queries=result.final)
        for result in results]


# --------------------------------------------------------------------------- scoring them


@dataclass
class ScoredQueries:
    """The test queries and the seeded sample check stages are scored on, with their scoring pairs."""

    queries: list[Mapping[str, Any]]
    sample: list[Mapping[str, Any]]
    pairs: dict[str, list | None]  # "all", "sample" (None when the sample is every query)

    @classmethod
    def of(cls, test_records: Any, params: EvaluationParams, defaults: Mapping[str, str] | None = None) -> ScoredQueries:
        queries = candidate_table(test_records, params.seed)
        if params.max_queries:  # a deterministic slice (the smoke run's "small test slice")
            queries = queries[: params.max_queries]
        sample = sample_queries(queries, params.check_stage_queries, params.seed)
        return cls(queries, sample, {
            "all": query_pairs(queries, params.instructions, defaults),
            "sample": query_pairs(sample, params.instructions, defaults) if len(sample) < len(queries) else None})

    def which(self, model: ModelToScore) -> str:
        return "all" if model.all_queries or self.pairs["sample"] is None else "sample"


def reranker_options(params: EvaluationParams) -> dict[str, Any]:
    """`evaluation.reranker`, with `evaluation.instructions` when set."""
    options = dict(params.reranker)
    if params.instructions:
        options["instructions"] = params.instructions
    return options


def score_test_set(test_records: Any, stage_results: Sequence[StageResult], model: ModelConfig,
                   params: EvaluationParams, gpus: int, device: str, training: TrainingParams
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
    refuse_an_empty_test_split(test_records)  # `--pipelines evaluation` on its own: the same line as in `smoke`
    options = reranker_options(params)
    processes = int(params.scoring.processes or gpus or 1)
    device_type = resolve_device(str(options.get("device") or device or "auto"))
    cache = ScoreCache(params.score_cache.dir) if params.score_cache.enabled else None
    tests = ScoredQueries.of(test_records, params, family_of_config(model).DEFAULT_INSTRUCTIONS)
    models = models_to_score(stage_results, model, training, options)
    figures, values, left = {}, {}, []
    for candidate in models:
        which = tests.which(candidate)
        figures[candidate.name] = {
            "queries": len(tests.queries if which == "all" else tests.sample), "test_queries": len(tests.queries),
            "sampled": which == "sample", "pairs": len(tests.pairs[which]), "reused": False, "cache_key": None}
        if candidate.name == BASE and cache is not None:
            found = _from_cache(cache, candidate, tests.pairs[which], device_type, figures[BASE])
            if found is not None:
                values[BASE] = found
                continue
        left.append(candidate)
    if left and processes > 1:
        _score_launched(left, tests, processes, device_type, Path(params.scoring.work_dir), training.launch,
                        figures, values)
    else:
        for candidate in left:
            _score_here(candidate, tests.pairs[tests.which(candidate)], device_type, figures, values)
    for name, entry in figures.items():
        if "_cache" in entry:
            key, parts = entry.pop("_cache")
            cache.store(key, parts, values[name], {k: entry.get(k) for k in ("seconds", "pairs_per_s", "processes")})
    tables = [score_rows(tests.sample if figures[m.name]["sampled"] else tests.queries, m.name, values[m.name])
              for m in models]
    return pd.concat(tables, ignore_index=True), jsonable({
        "models": figures, "processes": processes, "device_type": device_type,
        "check_stage_queries": len(tests.sample), "seed": params.seed,
    })


def _from_cache(cache: ScoreCache, candidate: ModelToScore, pairs: list, device_type: str,
                figures: dict[str, Any]) -> list[float] | None:
    """The base model's cached scores, or None (and the key to store them under, in figures["_cache"])."""
    key, parts = cache_key(model_identity(candidate.source, candidate.adapter),
                           processing_settings(candidate.options, device_type), pairs_hash(pairs))
    figures["cache_key"] = key
    found = cache.lookup(key, len(pairs))
    if found is None:
        figures["_cache"] = (key, parts)
        return None
    logger.info("base model: reusing cached scores %s (same model, processing settings and test pairs)",
                cache.paths(key)[0])
    figures.update(reused=True, seconds=0.0, pairs_per_s=None, processes=0)
    return found


def load_reranker(candidate: ModelToScore) -> Any:
    from lychee_pipeline.reranker import Reranker

    # a stage's saved folder (LoRA adapter or full weights) names its own base model
    return Reranker.from_pretrained(candidate.adapter or candidate.source, **candidate.options)


def _score_here(candidate: ModelToScore, pairs: list, device_type: str, figures: dict, values: dict) -> None:
    started = time.perf_counter()
    logger.info("scoring %d pairs with %s (%s, adapter %s) in this process", len(pairs), candidate.name,
                candidate.source, candidate.adapter)
    reranker = load_reranker(candidate)
    loaded = time.perf_counter()
    values[candidate.name] = score_pairs_in_slices(reranker, pairs, f"scoring with {candidate.name}")
    del reranker
    done = time.perf_counter()
    figures[candidate.name].update(seconds=done - started, processes=1, device=device_type,
                                   pairs_per_s=len(pairs) / (done - loaded) if done > loaded else None)


def launch_scoring(spec: ScoringJobSpec, processes: int, device_type: str) -> dict[str, Any]:
    """One `accelerate launch` of `processes` processes running `score_shards` on `spec`; its result.json."""
    check_device_count(processes, device_type)
    folder = Path(spec.output_dir)
    job = LaunchJob(name=spec.stage, module=SCORING_MODULE, spec_file=folder / "spec.json", spec_text=spec.to_json(),
                    folder=folder, devices=processes, device_type=device_type, launch=spec.launch,
                    what=f"scoring launch {spec.stage!r}")
    return launch(job)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _score_launched(models: list[ModelToScore], tests: ScoredQueries, processes: int, device_type: str, work_dir: Path,
                    launch_params: LaunchParams, figures: dict, values: dict) -> None:
    """One `accelerate launch` of `processes` processes scoring every model left (see score_shards)."""
    check_device_count(processes, device_type)  # before any file is written
    work_dir.mkdir(parents=True, exist_ok=True)
    used = {tests.which(m) for m in models}
    paths = {which: write_pairs(tests.pairs[which], work_dir / f"pairs_{which}.parquet") for which in used}
    jobs = [ScoringJob(name=m.name, name_or_path=m.source, adapter=m.adapter,
                       options={k: v for k, v in m.options.items() if k != "device"},
                       pairs_path=str(paths[tests.which(m)].resolve()),
                       scores_path=str((work_dir / f"scores_{_safe(m.name)}.parquet").resolve()))
            for m in models]
    # the model's own dtype decides; no autocast on top of it
    spec = ScoringJobSpec(stage="scoring", output_dir=str(work_dir.resolve()), jobs=jobs,
                          launch=launch_params.model_copy(update={"mixed_precision": "no"}))
    logger.info("scoring %s on %d %s processes", ", ".join(j.name for j in jobs), processes, device_type.upper())
    try:
        result = launch_scoring(spec, processes, device_type)
    except StageFailed as exc:
        raise StageFailed(f"test-set scoring on {processes} {device_type} processes failed "
                          f"(work folder {work_dir}): {exc}") from exc
    for job, done in zip(jobs, result["jobs"], strict=True):
        values[job.name] = read_scores(done["scores_path"])
        figures[job.name].update({k: done[k] for k in ("seconds", "pairs_per_s", "processes", "device",
                                                       "load_seconds", "scoring_seconds")})


def jsonable(value: Any) -> Any:
    """Plain JSON types; NaN and infinities become ``None``."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        f = float(value)
        return f if math.isfinite(f) else None
    return value
