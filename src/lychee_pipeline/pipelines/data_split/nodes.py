"""Split nodes: query-grouped train/val/test split, the smoke subset, and the data counts."""

from __future__ import annotations

import hashlib
import logging
import os
from collections import Counter
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from lychee_pipeline.schema import MODEL_INPUT_SCHEMA, SPLITS

logger = logging.getLogger(__name__)


def _rank(seed: int, key: str) -> bytes:
    return hashlib.sha1(f"{seed}\x00{key}".encode()).digest()


def query_keys(records: pa.Table) -> list[str]:
    """The grouping key of each record: its query text and image file name (a query never crosses splits).

    The file name rather than the absolute path keeps the split the same wherever the data lies; two
    different images with one name only make a coarser group, never a leak.
    """
    texts = pc.struct_field(records.column("query"), "text").to_pylist()
    images = pc.struct_field(records.column("query"), "image").to_pylist()
    return [f"{t or ''}\x00{os.path.basename(i) if i else ''}" for t, i in zip(texts, images)]


def split_records(normalized_records: pa.Table, split: dict[str, Any]) -> tuple[pa.Table, pa.Table, pa.Table, dict]:
    """Assign whole query groups to train/val/test by seeded hash order and ratios, honouring pinned splits."""
    ratios = {name: float(split["ratios"][name]) for name in SPLITS}
    if any(r < 0 for r in ratios.values()) or abs(sum(ratios.values()) - 1.0) > 1e-6:
        raise ValueError(f"split.ratios must be non-negative and sum to 1, got {ratios}")
    seed = int(split.get("seed", 0))
    keys = query_keys(normalized_records)
    pinned = normalized_records.column("split").to_pylist()
    group_pin: dict[str, str] = {}
    conflicts = 0
    for key, pin in zip(keys, pinned):
        if pin is None:
            continue
        if group_pin.setdefault(key, pin) != pin:
            conflicts += 1
    if conflicts:
        logger.warning("%d records pin a query to another split than its first pinned record; the first pin wins",
                       conflicts)
    free = sorted({k for k in keys if k not in group_pin}, key=lambda k: _rank(seed, k))
    n_train = round(len(free) * ratios["train"])
    n_val = round(len(free) * ratios["val"])
    assigned = dict(group_pin)
    for i, key in enumerate(free):
        assigned[key] = "train" if i < n_train else "val" if i < n_train + n_val else "test"
    labels = pa.array([assigned[k] for k in keys], pa.string())
    table = normalized_records.set_column(normalized_records.schema.get_field_index("split"), "split", labels)
    parts = tuple(table.filter(pc.equal(labels, name)).cast(MODEL_INPUT_SCHEMA) for name in SPLITS)
    counts = {f"{name}_size": part.num_rows for name, part in zip(SPLITS, parts)}
    counts.update({f"{name}_queries": n for name, n in Counter(assigned.values()).items()})
    logger.info("split: %s", counts)
    return (*parts, counts)


def make_smoke_subset(train_records: pa.Table, sample_size: int, split: dict[str, Any]) -> pa.Table:
    """A deterministic sample of ``sample_size`` training records (all of them, with a warning, when fewer)."""
    n = train_records.num_rows
    if n <= sample_size:
        if n < sample_size:
            logger.warning("smoke subset: only %d training records for smoke.sample_size=%d; using all", n, sample_size)
        return train_records
    seed = int(split.get("seed", 0))
    ids = train_records.column("record_id").to_pylist()
    chosen = sorted(sorted(range(n), key=lambda i: _rank(seed, ids[i]))[:sample_size])
    return train_records.take(pa.array(chosen, pa.int64()))


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
