"""Image-normalization nodes: verify each unique image once, then resolve and filter the records
(over `lychee_pipeline.data.normalization`)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from lychee_pipeline.data import normalization as norm
from lychee_pipeline.data.params import ImageCheckParams, NormalizationParams
from lychee_pipeline.runtime.errors import typed


def check_images(
    ingested_records: pa.Table,
    previous_manifest: pa.Table | None,
    raw_source: dict[str, Any],
    image_check: dict[str, Any],
) -> pa.Table:
    """The image manifest: each unique resolved image checked once (`data_processing.image_check`)."""
    return norm.check_images(ingested_records, previous_manifest, raw_source,
                             typed(ImageCheckParams, "data_processing.image_check", image_check))


def normalize_records(
    ingested_records: pa.Table,
    image_manifest: pa.Table,
    raw_source: dict[str, Any],
    normalization: dict[str, Any],
) -> tuple[pa.Table, pa.Table, pa.Table, dict[str, int]]:
    """Records with checked image paths, the quarantined ones, the removed negatives and the counts
    (`data_processing.normalization`)."""
    return norm.normalize_records(ingested_records, image_manifest, raw_source,
                                  typed(NormalizationParams, "data_processing.normalization", normalization))
