"""Ingestion nodes: find the raw JSONL, then parse, validate, normalize, id and deduplicate it."""

from __future__ import annotations

import logging
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa

from lychee_pipeline.pipelines.data_ingestion.records import (
    MAX_TEXT_CHARS,
    chunk_ranges,
    discover_files,
    parse_chunk,
    read_line_at,
)
from lychee_pipeline.pipelines.demo_data.catalogue import ensure_demo_data
from lychee_pipeline.schema import MODEL_INPUT_SCHEMA

logger = logging.getLogger(__name__)


def image_roots_of(value: Any) -> list[str]:
    """`data.image_roots` as a list: a YAML list, or one string of roots separated by os.pathsep (':').

    The string form is what works on the command line, where Kedro splits --params on commas:
    ``--params "data.image_roots=/data/shop:/mnt/img"``.
    """
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)):
        value = str(value).split(os.pathsep)
    return [str(v).strip() for v in value if v is not None and str(v).strip()]


def locate_raw_data(data: dict[str, Any], demo_data: dict[str, Any]) -> dict[str, Any]:
    """Describe the raw JSONL files and image roots: the user's (`data.raw_path`) or the generated demo data."""
    if data.get("raw_path"):
        found = discover_files(str(data["raw_path"]))
        files = found["files"]
        roots = image_roots_of(data.get("image_roots")) or [str(Path(files[0]).parent)]
        source = {"files": files, "image_roots": [str(Path(r).expanduser().resolve()) for r in roots], "demo": False,
                  "found": found["entries"], "image_files": found["image_files"]}
    else:
        demo = ensure_demo_data(demo_data)
        source = {"files": demo["files"], "image_roots": demo["image_roots"], "demo": True,
                  "found": [_demo_entry(f) for f in demo["files"]], "image_files": demo.get("images", 0)}
    skipped = [e for e in source["found"] if e["status"] != "read"]
    logger.info("raw data: %d JSON lines file(s) read, %d other file(s) skipped, %d image file(s) beside them; "
                "image roots %s",
                len(source["files"]), len(skipped), source["image_files"], source["image_roots"])
    for entry in skipped[:50]:
        logger.warning("skipped %s: %s", entry["file"], entry["reason"])
    if len(skipped) > 50:
        logger.warning("... and %d more skipped file(s): see raw_files (data/02_intermediate/raw_files.json)",
                       len(skipped) - 50)
    return source


def _demo_entry(file: str) -> dict[str, Any]:
    return {"file": file, "status": "read", "reason": "generated demo catalogue", "compression": None,
            "lines": None, "clean": None, "rejected": None, "duplicates": None}


def raw_file_list(raw_source: dict[str, Any], per_file: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Every file found under data.raw_path, with its line counts when read, or why it was skipped."""
    found = raw_source.get("found") or [_demo_entry(f) for f in raw_source["files"]]
    entries = [{**e, **per_file.get(e["file"], {})} if e["status"] == "read" else e for e in found]
    for entry in entries:
        if entry["status"] == "read":
            logger.info("read %s: %s lines -> %s clean, %s rejected, %s duplicates%s", entry["file"], entry["lines"],
                        entry["clean"], entry["rejected"], entry["duplicates"],
                        f" ({entry['compression']})" if entry.get("compression") else "")
    return {"files": entries, "read": sum(e["status"] == "read" for e in entries),
            "skipped": sum(e["status"] != "read" for e in entries), "image_files": raw_source.get("image_files", 0)}


def _parsed_chunks(files: list[str], ingestion: dict[str, Any]):
    """Parsed byte ranges in file order: in this process, or in a pool of spawned workers for big inputs."""
    workers = int(ingestion.get("workers", 2))
    chunk_bytes = max(1, int(float(ingestion.get("chunk_mb", 16)) * 2**20))
    batch_size = int(ingestion.get("batch_size", 20000))
    max_raw_chars = int(ingestion.get("rejected_raw_chars", 10000))
    max_text_chars = int(ingestion.get("max_text_chars", MAX_TEXT_CHARS))
    if max_text_chars < 1:
        raise ValueError(f"invalid parameter data_processing.ingestion.max_text_chars: must be >= 1, got {max_text_chars}")
    ranges = chunk_ranges(files, chunk_bytes)
    tasks = [(file, start, end, batch_size, max_raw_chars, max_text_chars) for file, start, end in ranges]
    if workers <= 1 or len(tasks) < 2:
        yield from map(parse_chunk, tasks)
        return
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield from pool.map(parse_chunk, tasks)


def ingest_records(raw_source: dict[str, Any], ingestion: dict[str, Any]) -> tuple[pa.Table, list[dict], dict]:
    """Stream every line into validated records, rejected lines (with reasons) and counts; drop exact duplicates."""
    table, rejected, counts, _, _ = ingest_files(raw_source, ingestion)
    return table, rejected, counts


def ingest_files(
    raw_source: dict[str, Any], ingestion: dict[str, Any]
) -> tuple[pa.Table, list[dict], dict, dict, list[dict]]:
    """`ingest_records`, plus the list of every file found (raw_files) with its per-file line counts, and
    the duplicate lines: one row per exact duplicate (its file and line, and the first occurrence's file,
    line and record_id), so that no line is dropped without a trace."""
    max_raw_chars = int(ingestion.get("rejected_raw_chars", 10000))
    tables: list[pa.Table] = []
    rejected: list[dict[str, Any]] = []
    duplicate_lines: list[dict[str, Any]] = []
    seen_content: dict[bytes, tuple[str, int, str]] = {}  # content digest -> first (file, line, record_id)
    seen_ids: dict[str, tuple[str, int, str]] = {}
    lines_in = duplicates = 0
    line_base: dict[str, int] = {}
    per_file = {f: {"lines": 0, "clean": 0, "rejected": 0, "duplicates": 0} for f in raw_source["files"]}
    for chunk in _parsed_chunks(raw_source["files"], ingestion):
        file, base = chunk["file"], line_base.get(chunk["file"], 0)
        line_base[file] = base + chunk["n_lines"]
        stats = per_file[file]
        stats["lines"] += chunk["n_lines"]
        lines_in += chunk["n_lines"]
        events = [(r["line"], r) for r in chunk["rejected"]]
        keep = []
        for line, digest, given_id, offset in chunk["keys"]:
            first = seen_content.get(digest)
            if first is not None:
                duplicates += 1
                stats["duplicates"] += 1
                duplicate_lines.append({"file": file, "line": base + line, "id": given_id, "first_file": first[0],
                                        "first_line": first[1], "first_record_id": first[2]})
                keep.append(False)
                continue
            record_id = given_id or "r" + digest.hex()[:16]
            if record_id in seen_ids:
                reason = f"duplicate id '{record_id}' (first at {seen_ids[record_id][0]}:{seen_ids[record_id][1]})"
                raw = read_line_at(file, offset).decode("utf-8", errors="replace")[:max_raw_chars]
                events.append((line, {"file": file, "line": line, "reason": reason, "raw": raw}))
                keep.append(False)
                continue
            seen_ids[record_id] = seen_content[digest] = (file, base + line, record_id)
            keep.append(True)
        for _, row in sorted(events, key=lambda e: e[0]):
            rejected.append({**row, "line": base + row["line"]})
        stats["rejected"] += len(events)
        stats["clean"] += sum(keep)
        table = chunk["table"]
        tables.append(table if all(keep) else table.filter(pa.array(keep, pa.bool_())))
    table = pa.concat_tables(tables) if tables else MODEL_INPUT_SCHEMA.empty_table()
    counts = {"lines_in": lines_in, "clean": table.num_rows, "rejected": len(rejected), "duplicates": duplicates}
    if counts["lines_in"] != counts["clean"] + counts["rejected"] + counts["duplicates"]:
        raise AssertionError(f"count invariant broken: {counts}")
    if len(duplicate_lines) != duplicates:
        raise AssertionError(f"{duplicates} duplicates counted but {len(duplicate_lines)} listed")
    logger.info(
        "ingestion: lines_in=%d == clean=%d + rejected=%d + duplicates=%d",
        lines_in, counts["clean"], counts["rejected"], duplicates,
    )
    for row in rejected[:5]:
        logger.warning("rejected %s:%d: %s", row["file"], row["line"], row["reason"])
    for row in duplicate_lines[:5]:
        logger.warning("duplicate %s:%d: the same content as %s:%d (kept as %s)", row["file"], row["line"],
                       row["first_file"], row["first_line"], row["first_record_id"])
    if len(duplicate_lines) > 5:
        logger.warning("... %d duplicate lines in all: see duplicate_lines (data/02_intermediate/duplicate_lines.jsonl)",
                       len(duplicate_lines))
    return table, rejected, counts, raw_file_list(raw_source, per_file), duplicate_lines
