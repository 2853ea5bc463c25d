"""The batch rerank, Kedro-free: the model and the image roots its paths resolve under, the limit on refused
documents, scoring in large slices, ranks per query, and the summary. The candidates file (its format, what
is refused and why) is `lychee_pipeline.data.candidates`.

Image roots, so that a path the batch accepts is one the served model accepts (`mlflow_model.py`):

- ``rerank.image_roots`` when set (it replaces the others, as ``LYCHEE_IMAGE_ROOTS`` does where the model is
  served);
- else, for an MLflow model URI, the roots the served model uses: ``LYCHEE_IMAGE_ROOTS`` if set, else the roots
  logged with the model (the training data's). The input file's folder is not added: the server has no input
  file, and a path it would refuse must not be scored here;
- else (a hub id, a local folder, ``builtin:tiny``: nothing was logged) the input file's folder.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from lychee_pipeline.data import candidates as candidate_file
from lychee_pipeline.data.params import RerankParams

log = logging.getLogger(__name__)

SCORE_COLUMNS = ["line", "query_id", "doc_index", "doc_id", "status", "score", "rank", "reason"]

#: Where the batch rerank's image roots came from (said in the log, the summary and the refusal line).
ROOTS_FROM_SETTING = "rerank.image_roots"
ROOTS_FROM_ENV = "LYCHEE_IMAGE_ROOTS, as where the model is served"
ROOTS_FROM_MODEL = "the roots logged with the model"
ROOTS_FROM_INPUT = "the input file's folder: the model has no logged roots"


def is_mlflow_model(model: str) -> bool:
    """An MLflow model URI (``models:/name@alias``, ``runs:/...``, a logged model id ``m-...``, any ``scheme://``)."""
    return "://" in model or model.startswith(("models:/", "runs:/", "m-"))


@dataclass
class RerankModel:
    """The loaded scorer, what was loaded (for the summary), and the roots the served model would use."""

    scorer: Any
    info: dict[str, Any]
    served_roots: list[str] | None  # None: not an MLflow model (nothing served, no logged roots)
    load_s: float


def load_model(rerank: RerankParams) -> RerankModel:
    """The reranker for ``rerank.model``: an MLflow model URI loaded as the server loads it (its logged scoring
    settings and image roots), else a hub id, local folder or ``builtin:tiny`` with ``rerank.reranker``."""
    candidate_file.input_path(rerank)  # a missing input is said before the model loads
    from lychee_pipeline import registry

    started = time.perf_counter()
    model = rerank.model
    info: dict[str, Any] = {"model": model}
    if is_mlflow_model(model):
        if model.startswith("models:/"):
            info.update(registry.describe_model_uri(model))
        served = registry.load_served_model(model)
        return RerankModel(served.reranker, info, list(served.image_roots), time.perf_counter() - started)
    from lychee_pipeline.reranker import Reranker

    scorer = Reranker.from_pretrained(model, **dict(rerank.reranker))
    return RerankModel(scorer, info, None, time.perf_counter() - started)


def image_roots(rerank: RerankParams, model: RerankModel) -> tuple[list[str], str]:
    """(the roots, where they came from): see the module's docstring."""
    if rerank.image_roots:
        return list(rerank.image_roots), ROOTS_FROM_SETTING
    if model.served_roots is not None:
        from lychee_pipeline.mlflow_model import ENV_IMAGE_ROOTS

        return model.served_roots, ROOTS_FROM_ENV if os.environ.get(ENV_IMAGE_ROOTS) else ROOTS_FROM_MODEL
    return [str(candidate_file.input_path(rerank).parent)], ROOTS_FROM_INPUT


def read_candidates(rerank: RerankParams, model: RerankModel) -> dict[str, Any]:
    """Every line of ``rerank.input`` parsed and checked under the model's image roots; stops (one line, nothing
    scored) when more than ``rerank.max_refused_share`` of the documents are refused."""
    roots, roots_from = image_roots(rerank, model)
    candidates = candidate_file.read_candidates(rerank, roots, roots_from)
    candidates["refused"] = candidate_file.check_refused_share(candidates, rerank.max_refused_share)
    return candidates


def _score(pairs: list, scorer: Any, slice_pairs: int) -> list[float]:
    scores: list[float] = []
    for start in tqdm(range(0, len(pairs), slice_pairs), desc="reranking", unit="slice", disable=None):
        scores.extend(scorer.score_pairs(pairs[start : start + slice_pairs]))
    if len(scores) != len(pairs):
        raise RuntimeError(f"{len(scores)} scores for {len(pairs)} pairs")
    return scores


def _rank(lines: list[dict[str, Any]]) -> tuple[list[dict], pd.DataFrame]:
    """One result per line (ranked documents, or the refusal) and one table row per document (or refused line)."""
    results, rows = [], []
    for line in lines:
        if line["status"] != "scored":
            results.append(line)
            rows.append({"line": line["line"], "query_id": line["query_id"], "doc_index": None, "doc_id": None,
                         "status": "refused", "score": None, "rank": None, "reason": line["reason"]})
            continue
        scored = sorted((d for d in line["docs"] if not d["reason"]), key=lambda d: (-d["score"], d["doc_index"]))
        for rank, doc in enumerate(scored, start=1):
            doc["rank"] = rank
        ranked = [{"doc_id": d["doc_id"], "doc_index": d["doc_index"], "score": d["score"], "rank": d["rank"]}
                  for d in scored]
        refused_docs = [{"doc_id": d["doc_id"], "doc_index": d["doc_index"], "reason": d["reason"]}
                        for d in line["docs"] if d["reason"]]
        results.append({"line": line["line"], "query_id": line["query_id"], "status": "scored",
                        "ranked": ranked, "refused_docs": refused_docs})
        for d in line["docs"]:
            rows.append({"line": line["line"], "query_id": line["query_id"], "doc_index": d["doc_index"],
                         "doc_id": d["doc_id"], "status": "refused" if d["reason"] else "scored",
                         "score": d.get("score"), "rank": d.get("rank"), "reason": d["reason"]})
    table = pd.DataFrame(rows, columns=SCORE_COLUMNS).astype(
        {"line": "int64", "doc_index": "Int64", "rank": "Int64", "score": "float64"})
    return results, table


def score_and_rank(candidates: dict[str, Any], model: RerankModel,
                   rerank: RerankParams) -> tuple[list[dict], pd.DataFrame, dict]:
    """Scores and 1-based ranks (best first, ties in input order) per scored line; refusals kept with reasons."""
    lines = candidates["lines"]
    pairs, where = [], []
    for line in lines:
        if line["status"] == "scored":
            for doc in line["docs"]:
                if not doc["reason"]:
                    pairs.append((line["query"], {"text": doc["text"], "image": doc["image"]}))
                    where.append(doc)
    started = time.perf_counter()
    scores = _score(pairs, model.scorer, rerank.slice_pairs)  # large slices keep the scorer's length sorting useful
    score_s = time.perf_counter() - started
    for doc, score in zip(where, scores):
        doc["score"] = float(score)
    results, table = _rank(lines)

    n_scored = sum(1 for r in results if r["status"] == "scored")
    n_refused = len(results) - n_scored
    if n_scored + n_refused != len(lines) or len(results) != len(lines):
        raise RuntimeError(f"{len(lines)} input lines but {n_scored} scored + {n_refused} refused")
    docs_refused = sum(len(r["refused_docs"]) for r in results if r["status"] == "scored")
    reason_kind = candidate_file.reason_kind
    summary = {
        "input": candidates["input"],
        "image_roots": candidates["image_roots"],
        "image_roots_from": candidates["image_roots_from"],
        **model.info,
        "lines_in": len(lines),
        "lines_scored": n_scored,
        "lines_refused": n_refused,
        "refused_lines_by_reason": dict(Counter(reason_kind(r["reason"]) for r in results if r["status"] != "scored")),
        "docs_scored": len(pairs),
        "docs_refused": docs_refused,
        "refused_docs_by_reason": dict(Counter(reason_kind(d["reason"]) for r in results if r["status"] == "scored"
                                               for d in r["refused_docs"])),
        "refused_share": round(candidates["refused"]["refused"] / candidates["refused"]["docs_in"], 4)
        if candidates["refused"]["docs_in"] else 0.0,
        "max_refused_share": rerank.max_refused_share,
        "model_load_s": round(model.load_s, 3),
        "scoring_s": round(score_s, 3),
        "pairs_per_s": round(len(pairs) / score_s, 2) if score_s > 0 and pairs else None,
        "outputs": {"results": "data/07_model_output/rerank_results.jsonl",
                    "scores": "data/07_model_output/rerank_scores.parquet",
                    "summary": "data/08_reporting/rerank_summary.json"},
    }
    log.info("rerank summary: %d line(s) in -> %d scored, %d refused (%s); documents of the scored lines: %d "
             "scored, %d refused (%s); model %s; %.1f pairs/s", summary["lines_in"], n_scored, n_refused,
             summary["refused_lines_by_reason"] or "none", len(pairs), docs_refused,
             summary["refused_docs_by_reason"] or "none", rerank.model, summary["pairs_per_s"] or 0.0)
    return results, table, summary
