"""The data_ingestion pipeline: raw JSONL -> ingested records, rejected lines, counts (02_intermediate)."""

from __future__ import annotations

from kedro.pipeline import Pipeline, node

from lychee_pipeline.pipelines.data_ingestion.nodes import ingest_files, locate_raw_data


def create_pipeline(**kwargs) -> Pipeline:
    """Locate the raw data, then parse and validate it."""
    return Pipeline(
        [
            node(locate_raw_data, ["params:data", "params:demo_data"], "raw_source", name="locate_raw_data"),
            node(
                ingest_files,
                ["raw_source", "params:data_processing.ingestion"],
                ["ingested_records", "rejected_lines", "ingestion_counts", "raw_files", "duplicate_lines"],
                name="parse_validate_dedup_records",
            ),
        ]
    )
