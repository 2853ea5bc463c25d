"""Candidates files of the batch rerank, Kedro-free: one query with its documents per line, each line parsed,
its images confined by the one image-path rule and checked, and then scored or refused with a reason.

One line per query: ``{"id": "q1", "query": "red dress" | {"text": ..., "image": ...}, "docs": [doc, ...]}``
where each doc has the raw format's document shape (``id``, ``text``, ``image``, ``meta``, ``hard``).
Every line is accounted for: scored, or refused with a reason (malformed JSON, a wrong field, no document,
a query image that is missing or outside ``rerank.image_roots``). A document whose image is missing,
unreadable or outside the roots is refused on its own (with its reason); the line's other documents are
scored.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from lychee_pipeline.data.images import Resolver, check_image
from lychee_pipeline.data.params import RerankParams
from lychee_pipeline.data.records import norm_ref, norm_text, reason_of
from lychee_pipeline.schema import RawDoc, RawItem, blank

log = logging.getLogger(__name__)

RAW_CHARS = 2000  # raw text kept per refused line


class CandidateLine(BaseModel):
    """One line of a candidates file."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str | None = None
    query: str | RawItem
    docs: list[RawDoc]


def _roots(rerank: RerankParams, input_path: Path) -> list[str]:
    roots = rerank.image_roots or [str(input_path.parent)]
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


def read_candidates(rerank: RerankParams) -> dict[str, Any]:
    """Parse and check every line: ``{"lines": [...], "input", "image_roots"}``; a line is scored or refused."""
    if not rerank.input:
        raise ValueError('rerank.input is not set: kedro run --pipelines rerank --params "rerank.input=<file.jsonl>"')
    path = Path(rerank.input).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"rerank.input: no file at {path}")
    roots = _roots(rerank, path)
    resolver = Resolver(roots)
    checked: dict[str, str | None] = {}
    max_pixels = rerank.max_image_pixels
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
