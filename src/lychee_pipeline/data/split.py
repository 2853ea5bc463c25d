"""The query-grouped train/val/test split and the smoke subset (Kedro-free)."""

from __future__ import annotations

import hashlib
import logging
import os
from collections import Counter
from collections.abc import Sized
import pyarrow as pa
import pyarrow.compute as pc

from lychee_pipeline.data.params import SplitParams
from lychee_pipeline.runtime.errors import InvalidParameter, UnreadableData
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


def _unit(seed: int, key: str) -> float:
    """The query's seeded hash as a number in [0, 1): its place on the ratio line, independent of other queries."""
    return int.from_bytes(_rank(seed, key)[:8], "big") / 2**64


def split_records(normalized_records: pa.Table, split: SplitParams) -> tuple[pa.Table, pa.Table, pa.Table, dict]:
    """Assign whole query groups to train/val/test by a seeded hash of the query, honouring pinned splits.

    ``method: hash`` (the default) puts a query in the split whose share of [0, 1) holds its hash, so adding
    or removing other records never moves it (the ratios hold on average). ``method: ordered`` sorts the
    queries by hash and cuts at exact ratios, which moves queries whenever the total changes.
    """
    ratios = {name: float(getattr(split.ratios, name)) for name in SPLITS}
    if any(r < 0 for r in ratios.values()) or abs(sum(ratios.values()) - 1.0) > 1e-6:
        raise InvalidParameter(f"invalid parameter data_processing.split.ratios: must be non-negative and sum to 1, "
                               f"got {ratios}")
    method = split.method
    if method not in ("hash", "ordered"):
        raise InvalidParameter(f"invalid parameter data_processing.split.method: must be 'hash' or 'ordered', "
                               f"got {method!r}")
    seed = split.seed
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
    assigned = dict(group_pin)
    if method == "hash":
        cut_train, cut_val = ratios["train"], ratios["train"] + ratios["val"]
        for key in keys:
            if key not in assigned:
                u = _unit(seed, key)
                assigned[key] = "train" if u < cut_train else "val" if u < cut_val else "test"
    else:
        free = sorted({k for k in keys if k not in group_pin}, key=lambda k: _rank(seed, k))
        n_train = round(len(free) * ratios["train"])
        n_val = round(len(free) * ratios["val"])
        for i, key in enumerate(free):
            assigned[key] = "train" if i < n_train else "val" if i < n_train + n_val else "test"
    labels = pa.array([assigned[k] for k in keys], pa.string())
    table = normalized_records.set_column(normalized_records.schema.get_field_index("split"), "split", labels)
    parts = tuple(table.filter(pc.equal(labels, name)).cast(MODEL_INPUT_SCHEMA) for name in SPLITS)
    counts = {f"{name}_size": part.num_rows for name, part in zip(SPLITS, parts)}
    by_split = Counter(assigned.values())
    counts.update({f"{name}_queries": n for name, n in by_split.items()})
    if not assigned:
        logger.warning("split: no records to split: every record was rejected or quarantined (reasons in "
                       "rejected_lines and quarantined_records)")
    for name in SPLITS:  # the achieved share of queries, to compare with the configured ratios
        counts[f"{name}_ratio"] = round(by_split.get(name, 0) / len(assigned), 4) if assigned else 0.0
        if ratios[name] > 0 and assigned and not by_split.get(name):
            logger.warning("split: no query in %s (ratio %.3g): too few queries for the ratios", name, ratios[name])
    logger.info("split: %s", counts)
    return (*parts, counts)


def refuse_an_empty_test_split(test_records: Sized, split_counts: dict | None = None) -> None:
    """Evaluation ranks the test split's queries: with none, a run that evaluates stops in one line (before
    training, as the split comes out: `hooks.EmptyTestSplitHooks`), not after training on an empty ranking."""
    if len(test_records):
        return
    total = sum(int(split_counts.get(f"{name}_queries", 0)) for name in SPLITS) if split_counts else None
    found = "" if total is None else f"{total} quer{'y' if total == 1 else 'ies'} in all after the data layer, "
    raise UnreadableData(
        f"the test split has no query to evaluate on ({found}split by data_processing.split.ratios): add queries, "
        "raise data_processing.split.ratios.test, or pin queries to it with the record field \"split\": \"test\"")


def smoke_subset(train_records: pa.Table, sample_size: int, seed: int) -> pa.Table:
    """A deterministic sample of ``sample_size`` training records (all of them, with a warning, when fewer)."""
    n = train_records.num_rows
    if n <= sample_size:
        if n < sample_size:
            # not a problem (the demo data always has fewer): no warning in every run's log
            logger.info("smoke subset: all %d training records (smoke.sample_size=%d)", n, sample_size)
        return train_records
    ids = train_records.column("record_id").to_pylist()
    chosen = sorted(sorted(range(n), key=lambda i: _rank(seed, ids[i]))[:sample_size])
    return train_records.take(pa.array(chosen, pa.int64()))

