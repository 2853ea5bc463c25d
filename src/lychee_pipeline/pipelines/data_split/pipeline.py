"""The data_split pipeline: normalized records -> train/val/test, smoke subset, counts (05_model_input)."""

from __future__ import annotations

from kedro.pipeline import Pipeline, node

from lychee_pipeline.pipelines.data_split.nodes import collect_data_counts, make_smoke_subset, split_records


def create_pipeline(**kwargs) -> Pipeline:
    """Split by query, sample the smoke subset, and gather the counts."""
    return Pipeline(
        [
            node(
                split_records,
                ["normalized_records", "params:data_processing.split"],
                ["train_records", "val_records", "test_records", "split_counts"],
                name="split_by_query_group",
            ),
            node(
                make_smoke_subset,
                ["train_records", "params:smoke.sample_size", "params:data_processing.split"],
                "smoke_train_records",
                name="sample_smoke_subset",
            ),
            node(
                collect_data_counts,
                ["ingestion_counts", "normalization_counts", "split_counts", "smoke_train_records"],
                "data_counts",
                name="collect_data_counts",
            ),
        ]
    )
