"""Ingestion of raw JSONL files, Kedro-free: parse byte ranges (in a process pool for big inputs), drop exact
duplicates, and account for every line (clean, rejected with its reason, or a duplicate of an earlier one)."""

from __future__ import annotations

import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pyarrow as pa

from lychee_pipeline.data.params import IngestionParams
from lychee_pipeline.data.records import chunk_ranges, parse_chunk, read_line_at, rejected_row
from lychee_pipeline.runtime.errors import InvalidParameter
from lychee_pipeline.schema import MODEL_INPUT_SCHEMA

logger = logging.getLogger(__name__)


def demo_entry(file: str) -> dict[str, Any]:
    """The raw_files row of a generated demo catalogue file."""
    return {"file": file, "status": "read", "reason": "generated demo catalogue", "compression": None,
            "lines": None, "clean": None, "rejected": None, "duplicates": None}


def raw_file_list(raw_source: dict[str, Any], per_file: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Every file found under data.raw_path, with its line counts when read, or why it was skipped."""
    found = raw_source.get("found") or [demo_entry(f) for f in raw_source["files"]]
    entries = [{**e, **per_file.get(e["file"], {})} if e["status"] == "read" else e for e in found]
    for entry in entries:
        if entry["status"] == "read":
            logger.info("read %s: %s lines -> %s clean, %s rejected, %s duplicates%s", entry["file"], entry["lines"],
                        entry["clean"], entry["rejected"], entry["duplicates"],
                        f" ({entry['compression']})" if entry.get("compression") else "")
    return {"files": entries, "read": sum(e["status"] == "read" for e in entries),
            "skipped": sum(e["status"] != "read" for e in entries), "image_files": raw_source.get("image_files", 0)}


def _parsed_chunks(files: list[str], ingestion: IngestionParams):
    """Parsed byte ranges in file order: in this process, or in a pool of spawned workers for big inputs."""
    workers = ingestion.workers
    chunk_bytes = max(1, int(ingestion.chunk_mb * 2**20))
    max_text_chars = ingestion.max_text_chars
    if max_text_chars < 1:
        raise InvalidParameter(
            f"invalid parameter data_processing.ingestion.max_text_chars: must be >= 1, got {max_text_chars}")
    ranges = chunk_ranges(files, chunk_bytes)
    tasks = [(file, start, end, ingestion.batch_size, ingestion.rejected_raw_chars, max_text_chars)
             for file, start, end in ranges]
    if workers <= 1 or len(tasks) < 2:
        yield from map(parse_chunk, tasks)
        return
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield from pool.map(parse_chunk, tasks)


def ingest_files(
    raw_source: dict[str, Any], ingestion: IngestionParams
) -> tuple[pa.Table, list[dict], dict, dict, list[dict]]:
    """Validated records, rejected lines (with reasons) and counts, plus the list of every file found (raw_files) with its per-file line counts, and
    the duplicate lines: one row per exact duplicate (its file and line, and the first occurrence's file,
    line and record_id), so that no line is dropped without a trace."""
    max_raw_chars = ingestion.rejected_raw_chars
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
                events.append((line, rejected_row(file, line, reason, record_id, read_line_at(file, offset),
                                                  max_raw_chars)))
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
