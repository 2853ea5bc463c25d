"""Parsing, validation and normalization of raw JSONL lines (Kedro-free)."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import unicodedata
from pathlib import Path
from typing import Any

import pyarrow as pa
from pydantic import ValidationError

from lychee_pipeline.schema import MODEL_INPUT_SCHEMA, RawDoc, RawRecord

_META_ENCODER = json.JSONEncoder(ensure_ascii=False, sort_keys=True, separators=(", ", ": "))
_BOM = b"\xef\xbb\xbf"
_UNION_TAGS = {"str", "RawItem", "RawDoc", "list[RawDoc]", "literal['train','val','test']"}


class RejectedLine(Exception):
    """A line that cannot become a record; the message is the reason."""


def norm_text(value: str | None) -> str | None:
    """Unicode NFC, stripped; ``None`` for missing or empty text."""
    if value is None:
        return None
    value = unicodedata.normalize("NFC", value).strip()
    return value or None


def norm_ref(value: str | None) -> str | None:
    """An image reference, stripped (not NFC: it must match the file system); ``None`` when empty."""
    if value is None:
        return None
    value = value.strip()
    return value or None


def modality(text: str | None, image: str | None) -> str:
    """``t``, ``i`` or ``it`` for an item with that text and image."""
    if text and image:
        return "it"
    return "i" if image else "t"


def detect_language(text: str | None) -> str:
    """Script-based language of a query text: zh, ja, ko, ru, ar, en (any Latin script) or und."""
    if not text:
        return "und"
    if text.isascii():
        return "en" if any(ch.isalpha() for ch in text) else "und"
    han = kana = hangul = cyrillic = arabic = latin = 0
    for ch in text:
        o = ord(ch)
        if 0x3040 <= o <= 0x30FF:
            kana += 1
        elif 0xAC00 <= o <= 0xD7AF or 0x1100 <= o <= 0x11FF:
            hangul += 1
        elif 0x4E00 <= o <= 0x9FFF or 0x3400 <= o <= 0x4DBF or 0xF900 <= o <= 0xFAFF:
            han += 1
        elif 0x0400 <= o <= 0x04FF:
            cyrillic += 1
        elif 0x0600 <= o <= 0x06FF:
            arabic += 1
        elif o < 0x0250 and ch.isalpha():
            latin += 1
    if kana:
        return "ja"
    if hangul:
        return "ko"
    if han:
        return "zh"
    best = max((cyrillic, "ru"), (arabic, "ar"), (latin, "en"))
    return best[1] if best[0] else "und"


def _hash(*parts: Any) -> str:
    """SHA-1 of the parts (their repr: unambiguous, None differs from "")."""
    return hashlib.sha1(repr(parts).encode("utf-8")).hexdigest()


def reason_of(error: ValidationError) -> str:
    """A short, readable reason from a pydantic validation error (its first problem)."""
    first = error.errors(include_url=False)[0]
    kind = first["type"]
    loc = ".".join(str(p) for p in first["loc"] if str(p) not in _UNION_TAGS)
    if kind == "json_invalid":
        return f"malformed JSON: {first['ctx'].get('error', first['msg'])}"
    if kind == "missing":
        return f"missing field '{loc}'"
    if kind == "extra_forbidden":
        return f"unknown field '{loc}'"
    if kind == "value_error":
        message = str(first["ctx"]["error"])
        return message if not loc or message == "empty query" else f"{message} ('{loc}')"
    if kind == "model_type" and not loc:
        return "wrong type: the line is not a JSON object"
    return f"wrong type at '{loc}': {first['msg']}"


def _doc(doc: RawDoc, negative: bool) -> dict[str, Any]:
    text, image = norm_text(doc.text), norm_ref(doc.image)
    doc_id = norm_text(doc.id) or "d" + _hash(text, image)[:16]
    meta = _META_ENCODER.encode(doc.meta) if doc.meta else "{}"
    row = {"doc_id": doc_id, "text": text, "image": image, "meta": meta}
    if negative:
        row["hard"] = True if doc.hard is None else doc.hard
    return row


def parse_record(text: str) -> tuple[dict[str, Any], str, str | None]:
    """Validate and normalize one line: (row without record_id, content hash, given id). Raises RejectedLine."""
    if not text.strip():
        raise RejectedLine("empty line")
    try:
        raw = RawRecord.model_validate_json(text)
    except ValidationError as error:
        raise RejectedLine(reason_of(error)) from None
    if isinstance(raw.query, str):
        query = {"text": norm_text(raw.query), "image": None}
    else:
        query = {"text": norm_text(raw.query.text), "image": norm_ref(raw.query.image)}
    positives = [_doc(d, False) for d in ([raw.pos_doc] if raw.pos_doc else []) + list(raw.pos_docs or [])]
    negatives = [_doc(d, True) for d in raw.neg_docs or []]
    row = {
        "query": query,
        "positives": positives,
        "negatives": negatives,
        "task_type": f"{modality(query['text'], query['image'])}2"
        f"{modality(positives[0]['text'], positives[0]['image'])}",
        "language": detect_language(query["text"]),
        "split": raw.split,
    }
    content = _hash(
        query["text"], query["image"], raw.split, len(positives),
        *(v for d in positives for v in (d["doc_id"], d["text"], d["image"], d["meta"])),
        *(v for d in negatives for v in (d["doc_id"], d["text"], d["image"], d["meta"], d["hard"])),
    )
    return row, content, norm_text(raw.id)


def jsonl_files(raw_path: str) -> list[str]:
    """The JSONL files of a folder (recursively) or a glob, sorted."""
    path = Path(raw_path).expanduser()
    if path.is_dir():
        files = sorted(str(p) for p in path.rglob("*.jsonl"))
    elif path.is_file():
        files = [str(path)]
    else:
        files = sorted(p for p in glob.glob(str(path), recursive=True) if p.endswith(".jsonl"))
    if not files:
        raise FileNotFoundError(f"no JSONL files at data.raw_path={raw_path!r}")
    return files


def chunk_ranges(files: list[str], chunk_bytes: int) -> list[tuple[str, int, int]]:
    """Split files into (file, start, end) byte ranges that begin and end on line boundaries."""
    ranges = []
    for file in files:
        size = os.path.getsize(file)
        start = 0
        with open(file, "rb") as handle:
            while start < size:
                end = min(size, start + chunk_bytes)
                if end < size:
                    handle.seek(end)
                    handle.readline()
                    end = handle.tell()
                ranges.append((file, start, end))
                start = end
        if size == 0:
            ranges.append((file, 0, 0))
    return ranges


def parse_chunk(args: tuple[str, int, int, int, int]) -> dict[str, Any]:
    """Parse the lines of one byte range: an Arrow table of the parsed rows and what is needed to deduplicate.

    Line numbers are local to the range (1-based); ``n_lines`` lets the caller make them global.
    """
    file, start, end, batch_size, max_raw_chars = args
    rows: list[dict[str, Any]] = []
    batches: list[pa.RecordBatch] = []
    keys: list[tuple[int, bytes, str | None, int]] = []  # local line, content digest, given id, byte offset
    rejected: list[dict[str, Any]] = []
    number = 0
    with open(file, "rb") as handle:
        handle.seek(start)
        offset = start
        while offset < end:
            raw = handle.readline()
            number += 1
            line_offset, offset = offset, offset + len(raw)
            if line_offset == 0 and raw.startswith(_BOM):
                raw = raw[len(_BOM):]
            raw = raw.rstrip(b"\r\n")
            try:
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    raise RejectedLine(f"invalid UTF-8 at byte {error.start}") from None
                row, content, given_id = parse_record(text)
            except RejectedLine as reason:
                rejected.append({"file": file, "line": number, "reason": str(reason),
                                 "raw": raw.decode("utf-8", errors="replace")[:max_raw_chars]})
                continue
            row["record_id"] = given_id or "r" + content[:16]
            rows.append(row)
            keys.append((number, bytes.fromhex(content), given_id, line_offset))
            if len(rows) >= batch_size:
                batches.append(pa.RecordBatch.from_pylist(rows, schema=MODEL_INPUT_SCHEMA))
                rows = []
    if rows:
        batches.append(pa.RecordBatch.from_pylist(rows, schema=MODEL_INPUT_SCHEMA))
    table = pa.Table.from_batches(batches, schema=MODEL_INPUT_SCHEMA)
    return {"file": file, "table": table, "keys": keys, "rejected": rejected, "n_lines": number}


def read_line_at(file: str, offset: int) -> bytes:
    """The raw line of ``file`` that starts at byte ``offset`` (without its line ending)."""
    with open(file, "rb") as handle:
        handle.seek(offset)
        return handle.readline().rstrip(b"\r\n")
