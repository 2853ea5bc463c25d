"""Split nodes: query-grouped train/val/test split, the smoke subset, and the data counts (over `data.split`)."""

from __future__ import annotations

import logging
from typing import Any

import pyarrow as pa

from lychee_pipeline.data import split as splitting
from lychee_pipeline.data.params import SplitParams
from lychee_pipeline.runtime.errors import typed

logger = logging.getLogger(__name__)


def split_records(normalized_records: pa.Table, split: dict[str, Any]) -> tuple[pa.Table, pa.Table, pa.Table, dict]:
    """Whole query groups to train/val/test by a seeded hash of the query (`data_processing.split`)."""
    return splitting.split_records(normalized_records, typed(SplitParams, "data_processing.split", split))


def make_smoke_subset(train_records: pa.Table, sample_size: int, split: dict[str, Any]) -> pa.Table:
    """A deterministic sample of ``sample_size`` training records, seeded by the split's seed."""
    return splitting.smoke_subset(train_records, sample_size,
                                  typed(SplitParams, "data_processing.split", split).seed)


def collect_data_counts(
    ingestion_counts: dict[str, int],
    normalization_counts: dict[str, int],
    split_counts: dict[str, int],
    smoke_train_records: pa.Table,
) -> dict[str, int]:
    """One metrics dict of the whole data layer's counts."""
    counts = {**ingestion_counts, **normalization_counts, **split_counts, "smoke_size": smoke_train_records.num_rows}
    logger.info("data counts: %s", counts)
    return counts
