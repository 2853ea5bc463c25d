"""The image_normalization pipeline: image manifest (02) and normalized / quarantined records (03)."""

from __future__ import annotations

from kedro.pipeline import Pipeline, node

from lychee_pipeline.pipelines.image_normalization.nodes import check_images, normalize_records


def create_pipeline(**kwargs) -> Pipeline:
    """Check every unique image once, then resolve and filter the records."""
    return Pipeline(
        [
            node(
                check_images,
                ["ingested_records", "previous_image_manifest", "raw_source", "params:data_processing.image_check"],
                "image_manifest",
                name="check_unique_images",
            ),
            node(
                normalize_records,
                ["ingested_records", "image_manifest", "raw_source", "params:data_processing.normalization"],
                ["normalized_records", "quarantined_records", "removed_negatives", "normalization_counts"],
                name="resolve_and_quarantine_records",
            ),
        ]
    )
