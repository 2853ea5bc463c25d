"""Ingestion nodes: find the raw JSONL, then parse, validate, normalize, id and deduplicate it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pyarrow as pa

from lychee_pipeline.data import ingest
from lychee_pipeline.data.catalogue import ensure_demo_data
from lychee_pipeline.data.ingest import demo_entry
from lychee_pipeline.data.params import DataParams, IngestionParams
from lychee_pipeline.data.records import discover_files
from lychee_pipeline.runtime.errors import typed

logger = logging.getLogger(__name__)


def locate_raw_data(data: dict[str, Any], demo_data: dict[str, Any]) -> dict[str, Any]:
    """Describe the raw JSONL files and image roots: the user's (`data.raw_path`) or the generated demo data."""
    settings = typed(DataParams, "data", data)
    if settings.raw_path:
        found = discover_files(settings.raw_path)
        files = found["files"]
        roots = settings.image_roots or [str(Path(files[0]).parent)]
        source = {"files": files, "image_roots": [str(Path(r).expanduser().resolve()) for r in roots], "demo": False,
                  "found": found["entries"], "image_files": found["image_files"]}
    else:
        demo = ensure_demo_data(demo_data)
        source = {"files": demo["files"], "image_roots": demo["image_roots"], "demo": True,
                  "found": [demo_entry(f) for f in demo["files"]], "image_files": demo.get("images", 0)}
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


def ingest_records(raw_source: dict[str, Any], ingestion: dict[str, Any]) -> tuple[pa.Table, list[dict], dict]:
    """Stream every line into validated records, rejected lines (with reasons) and counts; drop exact duplicates."""
    table, rejected, counts, _, _ = ingest_files(raw_source, ingestion)
    return table, rejected, counts


def ingest_files(
    raw_source: dict[str, Any], ingestion: dict[str, Any]
) -> tuple[pa.Table, list[dict], dict, dict, list[dict]]:
    """`ingest_records`, plus every file found (raw_files) with its per-file line counts, and the duplicate
    lines (`data_processing.ingestion`)."""
    return ingest.ingest_files(raw_source, typed(IngestionParams, "data_processing.ingestion", ingestion))
