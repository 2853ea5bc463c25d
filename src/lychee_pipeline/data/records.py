"""Parsing, validation and normalization of raw JSONL lines (Kedro-free)."""

from __future__ import annotations

import bz2
import glob
import gzip
import hashlib
import json
import math
import os
import re
import unicodedata
import zlib
from pathlib import Path
from typing import Any

import pyarrow as pa
from pydantic import ValidationError

from lychee_pipeline.runtime.errors import MissingInput, UnreadableData
from lychee_pipeline.schema import MODEL_INPUT_SCHEMA, RawDoc, RawRecord, strip_invisible

_META_ENCODER = json.JSONEncoder(ensure_ascii=False, sort_keys=True, separators=(", ", ": "))
_BOM = b"\xef\xbb\xbf"
#: Default of ``data_processing.ingestion.max_text_chars``: a longer query or document text refuses its line.
MAX_TEXT_CHARS = 20000
_UNION_TAGS = {"str", "RawItem", "RawDoc", "list[RawDoc]", "literal['train','val','test']"}


class RejectedLine(Exception):
    """A line that cannot become a record; the message is the reason, ``given_id`` the line's ``id`` when it was
    parsed far enough to have one (else None)."""

    def __init__(self, reason: str, given_id: str | None = None) -> None:
        super().__init__(reason)
        self.given_id = given_id


def given_id_of(text: str) -> str | None:
    """The ``id`` of a line that is a JSON object with a text ``id`` (normalized as a record's), else None: how a
    rejected line can be found again. Python's JSON reader takes what the strict one refused (a lone surrogate,
    a wrong type elsewhere); an id that is not valid Unicode itself is left out."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    given = value.get("id") if isinstance(value, dict) else None
    if not isinstance(given, str):
        return None
    try:
        given.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return norm_text(given)


# A \uXXXX escape in JSON text (an escaped backslash, \\, is matched as its own escape so it never starts one).
_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{4}|.)", re.DOTALL)


def lone_surrogate(text: str) -> tuple[str, int] | None:
    """The first \\uD800-\\uDFFF escape of ``text`` that is not half of a pair (a high one followed by a low
    one), with its 1-based column; None when there is none. JSON text must be valid Unicode: a lone surrogate
    is half of a character (a line cut between the two halves of an emoji, say)."""
    escapes = [(m.start(), m.group(1)) for m in _ESCAPE.finditer(text)]
    for i, (start, escape) in enumerate(escapes):
        if escape[0] != "u" or not 0xD800 <= int(escape[1:], 16) <= 0xDFFF:
            continue
        code = int(escape[1:], 16)
        if code <= 0xDBFF and i + 1 < len(escapes):  # a high surrogate: paired when a low one follows at once
            after, follow = escapes[i + 1]
            if after == start + 6 and follow[0] == "u" and 0xDC00 <= int(follow[1:], 16) <= 0xDFFF:
                continue
        if code >= 0xDC00 and i > 0:  # a low surrogate: paired when it completes the escape just before
            before, lead = escapes[i - 1]
            if before == start - 6 and lead[0] == "u" and 0xD800 <= int(lead[1:], 16) <= 0xDBFF:
                continue
        return "\\" + escape, start + 1
    return None


def norm_text(value: str | None) -> str | None:
    """Unicode NFC, stripped; ``None`` for missing or empty text."""
    if value is None:
        return None
    value = strip_invisible(unicodedata.normalize("NFC", value))
    return value or None


def _non_finite(value: Any, loc: str) -> str | None:
    """The location of the first NaN or infinite number inside a meta value, or ``None``."""
    if isinstance(value, float) and not math.isfinite(value):
        return loc
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _non_finite(item, f"{loc}.{key}")
        if found:
            return found
    return None


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


def reason_of(error: ValidationError, text: str | None = None) -> str:
    """A short, readable reason from a pydantic validation error (its first problem); ``text``, the line, lets
    a JSON error caused by a lone surrogate escape say so (the parser's words are "unexpected end of hex
    escape" or "lone leading surrogate in hex escape")."""
    first = error.errors(include_url=False)[0]
    kind = first["type"]
    loc = ".".join(str(p) for p in first["loc"] if str(p) not in _UNION_TAGS)
    if kind == "json_invalid":
        detail = str(first["ctx"].get("error", first["msg"]))
        lone = lone_surrogate(text) if text is not None and ("surrogate" in detail or "hex escape" in detail) else None
        if lone:
            return (f"malformed JSON: lone surrogate {lone[0]} at column {lone[1]}: half of a UTF-16 pair, not a "
                    "character (JSON text must be valid Unicode: complete the pair, e.g. \\ud83d\\ude00, or "
                    "remove it)")
        return f"malformed JSON: {detail}"
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


def _too_long(query: dict[str, Any], docs: list[tuple[str, dict[str, Any]]], max_text_chars: int) -> str | None:
    """The reason a line is refused for a text longer than ``max_text_chars`` characters (after NFC), or None."""
    for loc, text in [("query", query["text"]), *((f"{loc}.text", doc["text"]) for loc, doc in docs)]:
        if text is not None and len(text) > max_text_chars:
            return (f"text too long: {len(text)} characters at '{loc}' > data_processing.ingestion.max_text_chars="
                    f"{max_text_chars} (never truncated: shorten it or raise the limit)")
    return None


def parse_record(text: str, max_text_chars: int = MAX_TEXT_CHARS) -> tuple[dict[str, Any], str, str | None]:
    """Validate and normalize one line: (row without record_id, content hash, given id). Raises RejectedLine.

    A query or document text longer than ``max_text_chars`` characters refuses the line (it is never cut)."""
    if not text.strip():
        raise RejectedLine("empty line")
    try:
        raw = RawRecord.model_validate_json(text)
    except ValidationError as error:
        raise RejectedLine(reason_of(error, text), given_id_of(text)) from None
    metas = ([("pos_doc", raw.pos_doc)] if raw.pos_doc else []) + [
        (f"{field}.{i}", d) for field in ("pos_docs", "neg_docs") for i, d in enumerate(getattr(raw, field) or [])]
    for loc, doc in metas:
        bad = doc.meta and _non_finite(doc.meta, f"{loc}.meta")
        if bad:
            raise RejectedLine(f"non-finite number (NaN, Infinity or out of range like 1e999) at '{bad}': "
                               "not valid JSON", norm_text(raw.id))
    if isinstance(raw.query, str):
        query = {"text": norm_text(raw.query), "image": None}
    else:
        query = {"text": norm_text(raw.query.text), "image": norm_ref(raw.query.image)}
    positives = [_doc(d, False) for d in ([raw.pos_doc] if raw.pos_doc else []) + list(raw.pos_docs or [])]
    negatives = [_doc(d, True) for d in raw.neg_docs or []]
    locs = (["pos_doc"] if raw.pos_doc else []) + [f"pos_docs.{i}" for i in range(len(raw.pos_docs or []))]
    locs += [f"neg_docs.{i}" for i in range(len(negatives))]
    too_long = _too_long(query, list(zip(locs, positives + negatives)), max_text_chars)
    if too_long:
        raise RejectedLine(too_long, norm_text(raw.id))
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


#: Names read as JSON lines (lower-cased), optionally compressed (the compression is found by magic bytes).
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz", ".jsonl.bz2", ".ndjson.bz2")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".gif", ".webp", ".bmp", ".tif", ".tiff", ".heic", ".avif")
# Each compression's header as far as it is fixed, so a text file that merely starts like one (a line "BZh...") is
# read as text: gzip's magic and deflate method byte; bzip2's magic, block size digit, then the first block's or the
# end-of-stream magic; zstd's frame magic; a zip's local file header.
_HEADERS = (("gzip", re.compile(rb"\x1f\x8b\x08")),
            ("bzip2", re.compile(rb"BZh[1-9](\x31\x41\x59\x26\x53\x59|\x17\x72\x45\x38\x50\x90)")),
            ("zstd", re.compile(rb"\x28\xb5\x2f\xfd")), ("zip", re.compile(rb"PK\x03\x04")))
_UTF_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32 LE"), (b"\x00\x00\xfe\xff", "UTF-32 BE"),
             (b"\xff\xfe", "UTF-16 LE"), (b"\xfe\xff", "UTF-16 BE"))


def compression_of(file: str) -> str | None:
    """``gzip``, ``bzip2``, ``zstd``, ``zip`` from the file's first bytes (:data:`_HEADERS`); ``None`` for text."""
    with open(file, "rb") as handle:
        head = handle.read(10)
    return next((name for name, header in _HEADERS if header.match(head)), None)


def open_raw(file: str):
    """The file as a binary stream, decompressed (gzip, bzip2) when it is compressed."""
    kind = compression_of(file)
    if kind == "gzip":
        return gzip.open(file, "rb")
    if kind == "bzip2":
        return bz2.open(file, "rb")
    return open(file, "rb")


_STREAM_ERRORS = (EOFError, OSError, zlib.error)  # what reading a corrupt or truncated gzip / bzip2 stream raises


def _corrupt_stream(file: str, error: BaseException) -> str:
    """The reason given for a gzip / bzip2 file whose stream breaks while it is read."""
    return (f"its {compression_of(file)} stream is corrupt or cut short ({error}); re-export or re-compress "
            "the file")


def encoding_problem(file: str) -> str | None:
    """Why a (decompressed) file is not UTF-8 JSON lines, from its first bytes; ``None`` when it may be."""
    try:
        with open_raw(file) as handle:
            head = handle.read(4)
    except _STREAM_ERRORS as error:
        if compression_of(file) is None:  # a plain file that cannot be read: not a stream problem
            raise
        return _corrupt_stream(file, error)
    for bom, name in _UTF_BOMS:
        if head.startswith(bom):
            return f"encoding {name} (byte-order mark {bom.hex(' ')}): re-save the file as UTF-8"
    if len(head) >= 4 and head[1] == 0 and head[3] == 0 and head[0] and head[2]:
        return "encoding UTF-16 LE without byte-order mark (every second byte is 0): re-save the file as UTF-8"
    if len(head) >= 4 and head[0] == 0 and head[2] == 0 and head[1] and head[3]:
        return "encoding UTF-16 BE without byte-order mark (every second byte is 0): re-save the file as UTF-8"
    return None


def _entry(file: str, status: str, reason: str, compression: str | None = None) -> dict[str, Any]:
    return {"file": file, "status": status, "reason": reason, "compression": compression,
            "lines": None, "clean": None, "rejected": None, "duplicates": None}


def _check_readable(file: str, why: str) -> dict[str, Any]:
    """An entry for a file chosen by name: read, or skipped for its compression or encoding, or because it
    cannot be opened (a symbolic link to nothing, no permission): such a file is listed, never a crash."""
    if os.path.islink(file) and not os.path.exists(file):
        target = os.path.join(os.path.dirname(file), os.readlink(file))
        return _entry(file, "skipped", f"broken symbolic link: it points to {target}, which does not exist")
    try:
        kind = compression_of(file)
    except OSError as error:
        return _entry(file, "skipped", f"cannot be read: {error.strerror or error}")
    if kind in ("zstd", "zip"):
        return _entry(file, "skipped", f"{kind} compressed: not supported, decompress it (gzip and bzip2 are read)",
                      kind)
    problem = encoding_problem(file)
    if problem:
        return _entry(file, "skipped", problem, kind)
    return _entry(file, "read", why, kind)


def _by_name(file: Path, in_export: bool) -> dict[str, Any] | None:
    """Classify one file found in a folder by its name; ``None`` for image files (only counted)."""
    name = file.name.lower()
    if name.startswith("."):
        return _entry(str(file), "skipped", "hidden file")
    if name.startswith("_"):
        return _entry(str(file), "skipped", "metadata file (name starts with _)")
    if name.endswith(JSONL_SUFFIXES):
        return _check_readable(str(file), "JSON lines file")
    if name.endswith(IMAGE_SUFFIXES):
        return None
    if in_export:
        stem = name.removesuffix(".gz").removesuffix(".bz2")
        if name.startswith("part") or stem.endswith(".json") or "." not in stem:
            return _check_readable(str(file), "part file of a folder export")
        return _entry(str(file), "skipped", "not a part file of the folder export (part-*, *.json, no extension)")
    if name.endswith((".json", ".json.gz")):
        return _entry(str(file), "skipped", "extension .json is not read: rename it .jsonl if it holds one object "
                                            "per line")
    return _entry(str(file), "skipped", "not a JSON lines file (.jsonl, .ndjson, optionally .gz / .bz2)")


def _walk(folder: Path, in_export: bool) -> tuple[list[dict[str, Any]], int]:
    """Every file under a folder (sorted), skipping hidden folders; also the number of image files seen."""
    entries: list[dict[str, Any]] = []
    images = 0
    for current, dirs, files in os.walk(folder):
        here = Path(current)
        export_here = in_export or any(p.lower().endswith((".jsonl", ".ndjson")) for p in here.relative_to(folder).parts)
        for name in sorted(dirs):
            if name.startswith("."):
                entries.append(_entry(str(here / name) + os.sep, "skipped", "hidden folder"))
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            entry = _by_name(here / name, bool(export_here))
            if entry is None:
                images += 1
            else:
                entries.append(entry)
    return entries, images


def discover_files(raw_path: str) -> dict[str, Any]:
    """Every file found at ``data.raw_path`` with whether it is read, and why (or why not).

    A folder is walked recursively (hidden folders and files are skipped); a folder whose name ends in
    ``.jsonl`` / ``.ndjson`` (a Spark or Hugging Face export) is read as its part files; a glob selects
    JSON lines files and folders; a single file is read whatever its name. Compressed files (gzip, bzip2)
    are recognised by their first bytes; UTF-16/32 files are skipped with the encoding as reason.
    """
    path = Path(raw_path).expanduser()
    images = 0
    if path.is_dir():
        entries, images = _walk(path, path.name.lower().endswith((".jsonl", ".ndjson")))
    elif path.is_file():
        entries = [_check_readable(str(path), "the file named by data.raw_path")]
    else:
        entries = []
        for match in sorted(glob.glob(str(path), recursive=True)):
            if os.path.isdir(match):
                if match.lower().rstrip(os.sep).endswith((".jsonl", ".ndjson")):
                    found, n = _walk(Path(match), True)
                    entries += found
                    images += n
            else:
                entry = _by_name(Path(match), False)
                if entry is None:
                    images += 1
                else:
                    entries.append(entry)
    entries.sort(key=lambda e: e["file"])
    files = [e["file"] for e in entries if e["status"] == "read"]
    if not files:
        skipped = "; ".join(f"{e['file']}: {e['reason']}" for e in entries[:10])
        raise MissingInput(f"no JSON lines files to read at data.raw_path={raw_path!r}"
                                + (f" ({skipped})" if skipped else ""))
    return {"files": files, "entries": entries, "image_files": images}


def jsonl_files(raw_path: str) -> list[str]:
    """The JSON lines files read from a folder (recursively), a glob or one file, sorted."""
    return discover_files(raw_path)["files"]


def chunk_ranges(files: list[str], chunk_bytes: int) -> list[tuple[str, int, int]]:
    """Split files into (file, start, end) byte ranges that begin and end on line boundaries."""
    ranges = []
    for file in files:
        if compression_of(file):
            ranges.append((file, 0, -1))  # a compressed stream is read whole, in one range
            continue
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


def parse_chunk(args: tuple) -> dict[str, Any]:
    """Parse the lines of one byte range: an Arrow table of the parsed rows and what is needed to deduplicate.

    ``args``: (file, start, end, batch_size, max_raw_chars[, max_text_chars]). Line numbers are local to the
    range (1-based); ``n_lines`` lets the caller make them global.
    """
    file, start, end, batch_size, max_raw_chars = args[:5]
    max_text_chars = int(args[5]) if len(args) > 5 else MAX_TEXT_CHARS
    rows: list[dict[str, Any]] = []
    batches: list[pa.RecordBatch] = []
    keys: list[tuple[int, bytes, str | None, int]] = []  # local line, content digest, given id, byte offset
    rejected: list[dict[str, Any]] = []
    number = 0
    whole = end < 0  # a compressed file: its decompressed stream, to the end
    with open_raw(file) if whole else open(file, "rb") as handle:
        handle.seek(start)
        offset = start
        while whole or offset < end:
            try:
                raw = handle.readline()
            except _STREAM_ERRORS as error:
                if not whole:  # a plain file that cannot be read: not a stream problem
                    raise
                raise UnreadableData(f"{file}, after line {number}: {_corrupt_stream(file, error)}") from None
            if whole and not raw:
                break
            number += 1
            line_offset, offset = offset, offset + len(raw)
            if line_offset == 0 and raw.startswith(_BOM):
                raw = raw[len(_BOM):]
            raw = raw.rstrip(b"\r\n")
            try:
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    raise RejectedLine(f"invalid UTF-8 at byte {error.start}{_latin1_hint(raw)}") from None
                row, content, given_id = parse_record(text, max_text_chars)
            except RejectedLine as reason:
                rejected.append(rejected_row(file, number, str(reason), reason.given_id, raw, max_raw_chars))
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


def rejected_row(file: str, line: int, reason: str, given_id: str | None, raw: bytes, max_raw_chars: int
                 ) -> dict[str, Any]:
    """A row of ``rejected_lines``: where the line is (file, 1-based line number), why, its ``id`` when it was
    parsed far enough to have one, its text cut to ``max_raw_chars`` characters and its whole length in
    characters (``raw_chars``), so a long line can be found again by id or number."""
    text = raw.decode("utf-8", errors="replace")
    return {"file": file, "line": line, "id": given_id, "reason": reason, "raw": text[:max_raw_chars],
            "raw_chars": len(text)}


def _latin1_hint(raw: bytes) -> str:
    """A hint naming the likely encoding of a line that is not UTF-8 (Latin-1 / Windows-1252), or ''."""
    try:
        raw.decode("cp1252")
    except UnicodeDecodeError:
        return ""
    return " (looks like Latin-1 / Windows-1252: re-save the file as UTF-8)"


def read_line_at(file: str, offset: int) -> bytes:
    """The raw line of ``file`` that starts at byte ``offset`` (without its line ending)."""
    with open_raw(file) as handle:
        handle.seek(offset)
        return handle.readline().rstrip(b"\r\n")
