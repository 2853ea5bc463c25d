"""Batch rerank nodes: read a candidates JSONL (`lychee_pipeline.data.candidates`: the file format and
what is refused), score every (query, document) pair, rank per query."""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from lychee_pipeline.data import candidates as candidate_file
from lychee_pipeline.data.params import RerankParams
from lychee_pipeline.runtime.errors import typed

log = logging.getLogger(__name__)

SCORE_COLUMNS = ["line", "query_id", "doc_index", "doc_id", "status", "score", "rank", "reason"]


def read_candidates(rerank: dict[str, Any]) -> dict[str, Any]:
    """Parse and check every line of ``rerank.input``: ``{"lines": [...], "input", "image_roots"}``."""
    return candidate_file.read_candidates(typed(RerankParams, "rerank", rerank))


def load_scorer(model: str, rerank: RerankParams) -> tuple[Any, dict[str, Any]]:
    """The reranker for ``rerank.model``: an MLflow model URI (``models:/name@alias``, ``runs:/...``) through
    its logged scoring settings, else a hub id, local folder or ``builtin:tiny``. Also says what was loaded."""
    from lychee_pipeline import registry

    info: dict[str, Any] = {"model": model}
    if "://" in model or model.startswith(("models:/", "runs:/", "m-")):
        if model.startswith("models:/"):
            info.update(registry.describe_model_uri(model))
        return registry.load_scorer(model), info
    from lychee_pipeline.reranker import Reranker

    return Reranker.from_pretrained(model, **dict(rerank.reranker)), info


def score_and_rank(candidates: dict[str, Any], rerank: dict[str, Any]) -> tuple[list[dict], pd.DataFrame, dict]:
    """Scores and 1-based ranks (best first, ties in input order) per scored line; refusals kept with reasons."""
    rerank = typed(RerankParams, "rerank", rerank)
    model = rerank.model
    lines = candidates["lines"]
    pairs, where = [], []
    for line in lines:
        if line["status"] == "scored":
            for doc in line["docs"]:
                if not doc["reason"]:
                    pairs.append((line["query"], {"text": doc["text"], "image": doc["image"]}))
                    where.append(doc)
    started = time.perf_counter()
    scorer, model_info = load_scorer(model, rerank)
    load_s = time.perf_counter() - started
    started = time.perf_counter()
    step = rerank.slice_pairs  # large slices keep the scorer's length sorting useful
    scores: list[float] = []
    for start in tqdm(range(0, len(pairs), step), desc="reranking", unit="slice", disable=None):
        scores.extend(scorer.score_pairs(pairs[start : start + step]))
    score_s = time.perf_counter() - started
    if len(scores) != len(pairs):
        raise RuntimeError(f"{len(scores)} scores for {len(pairs)} pairs")
    for doc, score in zip(where, scores):
        doc["score"] = float(score)

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

    n_scored = sum(1 for r in results if r["status"] == "scored")
    n_refused = len(results) - n_scored
    if n_scored + n_refused != len(lines) or len(results) != len(lines):
        raise RuntimeError(f"{len(lines)} input lines but {n_scored} scored + {n_refused} refused")
    docs_refused = sum(len(r["refused_docs"]) for r in results if r["status"] == "scored")
    summary = {
        "input": candidates["input"],
        "image_roots": candidates["image_roots"],
        **model_info,
        "lines_in": len(lines),
        "lines_scored": n_scored,
        "lines_refused": n_refused,
        "refused_lines_by_reason": dict(Counter(_reason_kind(r["reason"]) for r in results if r["status"] != "scored")),
        "docs_scored": len(pairs),
        "docs_refused": docs_refused,
        "refused_docs_by_reason": dict(Counter(_reason_kind(d["reason"]) for r in results if r["status"] == "scored"
                                               for d in r["refused_docs"])),
        "model_load_s": round(load_s, 3),
        "scoring_s": round(score_s, 3),
        "pairs_per_s": round(len(pairs) / score_s, 2) if score_s > 0 and pairs else None,
        "outputs": {"results": "data/07_model_output/rerank_results.jsonl",
                    "scores": "data/07_model_output/rerank_scores.parquet",
                    "summary": "data/08_reporting/rerank_summary.json"},
    }
    log.info("rerank summary: %d line(s) in -> %d scored, %d refused (%s); documents of the scored lines: %d "
             "scored, %d refused (%s); model %s; %.1f pairs/s", summary["lines_in"], n_scored, n_refused,
             summary["refused_lines_by_reason"] or "none", len(pairs), docs_refused,
             summary["refused_docs_by_reason"] or "none", model, summary["pairs_per_s"] or 0.0)
    return results, table, summary


def _reason_kind(reason: str) -> str:
    """The reason without the path or detail after its first ': ' (for counting); `query image: <kind>` kept."""
    parts = str(reason).split(": ")
    return ": ".join(parts[:2]) if parts[0] == "query image" and len(parts) > 2 else parts[0]
