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
from collections import Counter
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from lychee_pipeline.data.images import Resolver, check_image
from lychee_pipeline.data.params import RerankParams
from lychee_pipeline.data.records import norm_ref, norm_text, reason_of
from lychee_pipeline.runtime.errors import InvalidParameter, MissingInput, UnreadableData
from lychee_pipeline.schema import RawDoc, RawItem, blank

log = logging.getLogger(__name__)

RAW_CHARS = 2000  # raw text kept per refused line
NO_ROOTS = "no image roots (the model was logged without any): set rerank.image_roots"


class CandidateLine(BaseModel):
    """One line of a candidates file."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str | None = None
    query: str | RawItem
    docs: list[RawDoc]


def input_path(rerank: RerankParams) -> Path:
    """``rerank.input`` as a path to an existing file, or a one-line error."""
    if not rerank.input:
        raise InvalidParameter('invalid parameter rerank.input: not set: kedro run --pipelines rerank --params '
                               '"rerank.input=<file.jsonl>"')
    path = Path(rerank.input).expanduser()
    if not path.is_file():
        raise MissingInput(f"rerank.input: no file at {path}")
    return path


def _image(ref: str, resolver: Resolver | None, checked: dict[str, str | None],
           max_pixels: int) -> tuple[str | None, str | None]:
    """(absolute path, None) or (None, reason): confined to the roots, decodable."""
    if resolver is None:
        return None, f"{NO_ROOTS}: {ref}"
    path, reason = resolver.resolve(ref)
    if path is None:
        return None, reason
    if path not in checked:
        row = check_image(path, max_pixels)
        checked[path] = None if row["ok"] else str(row["reason"])
    return (path, None) if checked[path] is None else (None, f"{checked[path]}: {ref}")


def read_candidates(rerank: RerankParams, image_roots: list[str], roots_from: str) -> dict[str, Any]:
    """Parse and check every line, image paths confined to ``image_roots`` (``roots_from`` says whose they
    are): ``{"lines": [...], "input", "image_roots", "image_roots_from"}``; a line is scored or refused."""
    path = input_path(rerank)
    roots = [str(Path(r).expanduser().resolve()) for r in image_roots]
    resolver = Resolver(roots) if roots else None  # no roots: every image path is refused, as the server does
    checked: dict[str, str | None] = {}
    max_pixels = rerank.max_image_pixels
    lines: list[dict[str, Any]] = []
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            lines.append(_parse_line(number, raw, resolver, checked, max_pixels))
    refused = sum(1 for line in lines if line["status"] == "refused")
    log.info("rerank input %s: %d line(s), %d to score, %d refused; image roots %s (%s)",
             path, len(lines), len(lines) - refused, refused, roots, roots_from)
    return {"input": str(path.resolve()), "image_roots": roots, "image_roots_from": roots_from, "lines": lines}


def reason_kind(reason: str) -> str:
    """The reason without the path or detail after its first ': ' (for counting); `query image: <kind>` kept."""
    parts = str(reason).split(": ")
    return ": ".join(parts[:2]) if parts[0] == "query image" and len(parts) > 2 else parts[0]


def refused_documents(candidates: dict[str, Any]) -> dict[str, Any]:
    """Documents in and refused, by reason, and the first one refused. A refused line's documents are all
    refused (under the line's reason); a line that could not be parsed counts as one document (its
    documents cannot be counted); an empty line holds none."""
    total, by_reason, first = 0, Counter(), None
    for line in candidates["lines"]:
        if line["status"] == "refused":
            count = line.get("docs_in")
            count = (0 if line["reason"] == "empty line" else 1) if count is None else count
            total += count
            for reason in line.get("doc_reasons") or [line["reason"]] * count:
                by_reason[reason_kind(reason)] += 1
            if count:
                first = first or f"line {line['line']}: {line['reason']}"
            continue
        total += len(line["docs"])
        for doc in line["docs"]:
            if doc["reason"]:
                by_reason[reason_kind(doc["reason"])] += 1
                first = first or f"line {line['line']}, doc {doc['doc_id']}: {doc['reason']}"
    return {"docs_in": total, "refused": sum(by_reason.values()), "by_reason": dict(by_reason), "first": first}


class RefusedShareError(UnreadableData):
    """More documents refused than ``rerank.max_refused_share`` allows."""


def check_refused_share(candidates: dict[str, Any], max_share: float) -> dict[str, Any]:
    """The refused documents (:func:`refused_documents`), or :class:`RefusedShareError` in one line naming the
    count by reason, the first one, the image roots and the setting, when their share exceeds ``max_share``."""
    refused = refused_documents(candidates)
    share = refused["refused"] / refused["docs_in"] if refused["docs_in"] else 0.0
    if share > max_share:
        reasons = ", ".join(f"{kind} {n}" for kind, n in sorted(refused["by_reason"].items(), key=lambda kv: -kv[1]))
        raise RefusedShareError(
            f"rerank refused {refused['refused']} of {refused['docs_in']} documents ({100 * share:.1f}%), more than "
            f"rerank.max_refused_share={max_share:g} allows: {reasons} (first: {refused['first']}); image roots "
            f"{candidates['image_roots']} ({candidates['image_roots_from']}); nothing was scored: fix the paths, set "
            "rerank.image_roots, or allow a share with --params rerank.max_refused_share=<0..1>")
    return refused


def _refused(number: int, raw: bytes | str, reason: str, query_id: str | None = None,
             docs_in: int | None = None) -> dict[str, Any]:
    """A refused line; ``docs_in``: how many documents it held (None when it could not be parsed)."""
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    return {"line": number, "query_id": query_id, "status": "refused", "reason": reason, "docs_in": docs_in,
            "raw": text.rstrip("\r\n")[:RAW_CHARS]}


def _parse_line(number: int, raw: bytes, resolver: Resolver | None, checked: dict, max_pixels: int) -> dict[str, Any]:
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
        return _refused(number, text, reason_of(error, text))
    query_id = norm_text(parsed.id) or f"line-{number}"
    if isinstance(parsed.query, str):
        query = {"text": norm_text(parsed.query), "image": None}
    else:
        query = {"text": norm_text(parsed.query.text), "image": norm_ref(parsed.query.image)}
    if blank(query["text"]) and not query["image"]:
        return _refused(number, text, "empty query", query_id, len(parsed.docs))
    if query["image"]:
        query["image"], reason = _image(query["image"], resolver, checked, max_pixels)
        if reason:
            return _refused(number, text, f"query image: {reason}", query_id, len(parsed.docs))
    if not parsed.docs:
        return _refused(number, text, "no documents", query_id, 0)
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
        refused = _refused(number, text, "no document left to score: " + "; ".join(
            f"doc {d['doc_id']}: {d['reason']}" for d in docs)[:RAW_CHARS], query_id, len(docs))
        return {**refused, "doc_reasons": [d["reason"] for d in docs]}  # counted by their own reasons
    return {"line": number, "query_id": query_id, "status": "scored", "query": query, "docs": docs}
