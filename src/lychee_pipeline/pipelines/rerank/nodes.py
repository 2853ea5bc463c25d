"""Batch rerank nodes: read a candidates JSONL, score every (query, document) pair, rank per query.

One line per query: ``{"id": "q1", "query": "red dress" | {"text": ..., "image": ...}, "docs": [doc, ...]}``
where each doc has the raw format's document shape (``id``, ``text``, ``image``, ``meta``, ``hard``).
Every line is accounted for: scored, or refused with a reason (malformed JSON, a wrong field, no document,
a query image that is missing or outside ``rerank.image_roots``). A document whose image is missing,
unreadable or outside the roots is refused on its own (with its reason); the line's other documents are
scored.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pandas as pd
from pydantic import BaseModel, ConfigDict, ValidationError
from tqdm.auto import tqdm

from lychee_pipeline.pipelines.data_ingestion.records import norm_ref, norm_text, reason_of
from lychee_pipeline.pipelines.image_normalization.images import Resolver, check_image
from lychee_pipeline.schema import RawDoc, RawItem, blank

log = logging.getLogger(__name__)

RAW_CHARS = 2000  # raw text kept per refused line
SCORE_COLUMNS = ["line", "query_id", "doc_index", "doc_id", "status", "score", "rank", "reason"]


class CandidateLine(BaseModel):
    """One line of a candidates file."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str | None = None
    query: str | RawItem
    docs: list[RawDoc]


def _roots(rerank: dict[str, Any], input_path: Path) -> list[str]:
    from lychee_pipeline.pipelines.data_ingestion.nodes import image_roots_of

    roots = image_roots_of(rerank.get("image_roots")) or [str(input_path.parent)]
    return [str(Path(r).expanduser().resolve()) for r in roots]


def _image(ref: str, resolver: Resolver, checked: dict[str, str | None], max_pixels: int) -> tuple[str | None, str | None]:
    """(absolute path, None) or (None, reason): confined to the roots, decodable."""
    path, reason = resolver.resolve(ref)
    if path is None:
        return None, reason
    if path not in checked:
        row = check_image(path, max_pixels)
        checked[path] = None if row["ok"] else str(row["reason"])
    return (path, None) if checked[path] is None else (None, f"{checked[path]}: {ref}")


def read_candidates(rerank: dict[str, Any]) -> dict[str, Any]:
    """Parse and check every line: ``{"lines": [...], "input", "image_roots"}``; a line is scored or refused."""
    if not rerank.get("input"):
        raise ValueError('rerank.input is not set: kedro run --pipelines rerank --params "rerank.input=<file.jsonl>"')
    path = Path(str(rerank["input"])).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"rerank.input: no file at {path}")
    roots = _roots(rerank, path)
    resolver = Resolver(roots)
    checked: dict[str, str | None] = {}
    max_pixels = int(rerank.get("max_image_pixels") or 50_000_000)
    lines: list[dict[str, Any]] = []
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            lines.append(_parse_line(number, raw, resolver, checked, max_pixels))
    refused = sum(1 for line in lines if line["status"] == "refused")
    log.info("rerank input %s: %d line(s), %d to score, %d refused; image roots %s",
             path, len(lines), len(lines) - refused, refused, roots)
    return {"input": str(path.resolve()), "image_roots": roots, "lines": lines}


def _refused(number: int, raw: bytes | str, reason: str, query_id: str | None = None) -> dict[str, Any]:
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    return {"line": number, "query_id": query_id, "status": "refused", "reason": reason,
            "raw": text.rstrip("\r\n")[:RAW_CHARS]}


def _parse_line(number: int, raw: bytes, resolver: Resolver, checked: dict, max_pixels: int) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
    except UnicodeDecodeError as exc:
        return _refused(number, raw, f"invalid UTF-8 at byte {exc.start}")
    if not text.strip():
        return _refused(number, text, "empty line")
    try:
        parsed = CandidateLine.model_validate_json(text)
    except ValidationError as error:
        unknown = [e for e in error.errors(include_url=False) if e["type"] == "extra_forbidden"]
        if unknown:  # a misnamed key is the likelier story than the missing one it causes
            loc = ".".join(str(p) for p in unknown[0]["loc"])
            return _refused(number, text, f"unknown field '{loc}' (a line has: id, query, docs)")
        return _refused(number, text, reason_of(error))
    query_id = norm_text(parsed.id) or f"line-{number}"
    if isinstance(parsed.query, str):
        query = {"text": norm_text(parsed.query), "image": None}
    else:
        query = {"text": norm_text(parsed.query.text), "image": norm_ref(parsed.query.image)}
    if blank(query["text"]) and not query["image"]:
        return _refused(number, text, "empty query", query_id)
    if query["image"]:
        query["image"], reason = _image(query["image"], resolver, checked, max_pixels)
        if reason:
            return _refused(number, text, f"query image: {reason}", query_id)
    if not parsed.docs:
        return _refused(number, text, "no documents", query_id)
    docs = []
    for index, doc in enumerate(parsed.docs):
        item = {"doc_index": index, "doc_id": norm_text(doc.id) or str(index), "text": norm_text(doc.text),
                "image": norm_ref(doc.image), "reason": None}
        if blank(item["text"]) and not item["image"]:
            item["reason"] = "empty document"
        elif item["image"]:
            item["image"], item["reason"] = _image(item["image"], resolver, checked, max_pixels)
        docs.append(item)
    if all(d["reason"] for d in docs):
        return _refused(number, text, "no document left to score: " + "; ".join(
            f"doc {d['doc_id']}: {d['reason']}" for d in docs)[:RAW_CHARS], query_id)
    return {"line": number, "query_id": query_id, "status": "scored", "query": query, "docs": docs}


def load_scorer(model: str, rerank: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The reranker for ``rerank.model``: an MLflow model URI (``models:/name@alias``, ``runs:/...``) through
    its logged scoring settings, else a hub id, local folder or ``builtin:tiny``. Also says what was loaded."""
    from lychee_pipeline import registry

    info: dict[str, Any] = {"model": model}
    if "://" in model or model.startswith(("models:/", "runs:/", "m-")):
        if model.startswith("models:/"):
            info.update(registry.describe_model_uri(model))
        return registry.load_scorer(model), info
    from lychee_pipeline.reranker import Reranker

    return Reranker.from_pretrained(model, **dict(rerank.get("reranker") or {})), info


def score_and_rank(candidates: dict[str, Any], rerank: dict[str, Any]) -> tuple[list[dict], pd.DataFrame, dict]:
    """Scores and 1-based ranks (best first, ties in input order) per scored line; refusals kept with reasons."""
    model = str(rerank.get("model") or "models:/lychee-reranker@champion")
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
    step = int(rerank.get("slice_pairs") or 1024)  # large slices keep the scorer's length sorting useful
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
