"""Image normalization, Kedro-free: verify each unique image once (a manifest reused while files are
unchanged), then resolve every record's image paths by the one image-path rule and set aside the records or
negatives that cannot be used, with the reason."""

from __future__ import annotations

import logging
import multiprocessing
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from lychee_pipeline.data.images import Resolver, check_image, check_image_task, stat_key
from lychee_pipeline.data.params import ImageCheckParams, NormalizationParams
from lychee_pipeline.project import stored_path
from lychee_pipeline.runtime.errors import InvalidParameter, UnreadableData
from lychee_pipeline.schema import MANIFEST_SCHEMA, MODEL_INPUT_SCHEMA, QUARANTINE_SCHEMA, REMOVED_NEGATIVE_SCHEMA
from lychee_pipeline.runtime.progress import CountedProgress

logger = logging.getLogger(__name__)


def image_refs(records: pa.Table) -> list[str]:
    """Every distinct image reference of the records (queries, positives, negatives)."""
    columns = [pc.struct_field(records.column("query"), "image")]
    for name in ("positives", "negatives"):
        columns.append(pc.struct_field(pc.list_flatten(records.column(name)), "image"))
    refs: set[str] = set()
    for column in columns:
        refs.update(v for v in pc.unique(column).to_pylist() if v is not None)
    return sorted(refs)


def check_images(
    ingested_records: pa.Table,
    previous_manifest: pa.Table | None,
    raw_source: dict[str, Any],
    image_check: ImageCheckParams,
) -> pa.Table:
    """Verify each unique resolved image once (in a process pool), reusing unchanged rows of the previous manifest."""
    max_pixels, workers, max_ratio = image_check.max_pixels, image_check.workers, image_check.max_aspect_ratio
    resolver = Resolver(raw_source["image_roots"])
    # stored relative to the project root when inside it: a moved project reuses its manifest and its stages
    resolved = [resolver.resolve(r) for r in image_refs(ingested_records)]
    paths = sorted({stored_path(p) for p, _ in resolved if p})
    unresolved = Counter(reason.split(": ", 1)[0] for _, reason in resolved if reason)
    previous: dict[str, dict[str, Any]] = {}
    if previous_manifest is not None and previous_manifest.num_rows:
        if set(MANIFEST_SCHEMA.names) <= set(previous_manifest.column_names):  # older layouts: check again
            for row in previous_manifest.to_pylist():
                if row.get("max_pixels") == max_pixels:
                    previous[row["path"]] = row
    rows: list[dict[str, Any]] = []
    todo: list[str] = []
    for path in paths:
        old = previous.get(path)
        if old is not None and old["size_bytes"] is not None and stat_key(path) == (old["size_bytes"], old["mtime_ns"]):
            rows.append(old)
        else:
            todo.append(path)
    logger.info("images: %d unique, %d reused from the manifest, %d to check%s", len(paths), len(rows), len(todo),
                f" ({sum(unresolved.values())} other references not resolved: counted below)" if unresolved else "")
    with CountedProgress("checking images", len(todo), "image") as progress:
        if workers > 1 and len(todo) > 64:
            # spawn: workers start small instead of inheriting a copy of this process's memory
            with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
                for row in pool.map(check_image_task, ((p, max_pixels, max_ratio) for p in todo), chunksize=256):
                    rows.append(row)
                    progress.update()
        else:
            for path in todo:
                rows.append(check_image(path, max_pixels, max_ratio))
                progress.update()
    rows.sort(key=lambda r: r["path"])
    manifest = pa.Table.from_pylist(rows, schema=MANIFEST_SCHEMA)
    bad = len(rows) - sum(r["ok"] for r in rows)
    logger.info("image manifest: %d images, %d bad; references not resolved: %s (the records or negatives using "
                "them are set aside next, with the reason)", len(rows), bad, dict(sorted(unresolved.items())) or "none")
    return manifest


def _fix(item: dict[str, Any], resolver: Resolver, status: dict[str, str | None]) -> str | None:
    """Replace ``item['image']`` by its checked path (relative to the project root when inside it, else
    absolute); return the reason when it is unusable."""
    ref = item.get("image")
    if ref is None:
        return None
    path, reason = resolver.resolve(ref)
    if path is None:
        return reason
    path = stored_path(path)
    if path not in status:
        return f"image not in the manifest: {ref}"
    if status[path] is not None:
        return f"{status[path]}: {ref}"
    item["image"] = path
    return None


def _distinct_negatives(row: dict[str, Any], collapsed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The record's negatives less those that are one of its positives and repeats of an earlier negative.

    A document is the same as another by doc_id or by content (text and image reference); each one dropped
    is appended to ``collapsed`` with its reason.
    """
    positives = {}
    for doc in row["positives"]:
        positives.setdefault(doc["doc_id"], doc["doc_id"])
        positives.setdefault((doc["text"], doc["image"]), doc["doc_id"])
    seen: dict[Any, str] = {}
    kept = []
    for doc in row["negatives"]:
        content = (doc["text"], doc["image"])
        same = positives.get(doc["doc_id"]) or positives.get(content)
        if same:
            reason = f"also a positive ({same}): a false negative"
        elif doc["doc_id"] in seen or content in seen:
            reason = f"duplicate negative (listed again after {seen.get(doc['doc_id']) or seen[content]})"
        else:
            seen[doc["doc_id"]] = seen[content] = doc["doc_id"]
            kept.append(doc)
            continue
        collapsed.append({"record_id": row["record_id"], "doc_id": doc["doc_id"], "image": doc["image"],
                          "reason": reason})
    return kept


def normalize_records(
    ingested_records: pa.Table,
    image_manifest: pa.Table,
    raw_source: dict[str, Any],
    normalization: NormalizationParams,
) -> tuple[pa.Table, pa.Table, pa.Table, dict[str, int]]:
    """Make image paths absolute; quarantine records with a bad query/positive image or too few negatives."""
    policy = normalization.policy
    if policy not in ("quarantine", "fail"):
        raise InvalidParameter(f"invalid parameter data_processing.normalization.policy: must be 'quarantine' or "
                               f"'fail', got {policy!r}")
    min_negatives = normalization.min_negatives
    resolver = Resolver(raw_source["image_roots"])
    status = dict(zip(image_manifest.column("path").to_pylist(),
                      [None if ok else reason for ok, reason in zip(image_manifest.column("ok").to_pylist(),
                                                                     image_manifest.column("reason").to_pylist())]))
    good_batches, bad_batches = [], []
    removed: list[dict[str, Any]] = []
    collapsed: list[dict[str, Any]] = []  # negatives that are also a positive, or listed twice
    for batch in ingested_records.to_batches(max_chunksize=20000):
        good, bad = [], []
        for row in batch.to_pylist():
            reason = _fix(row["query"], resolver, status)
            reason = f"query {reason}" if reason else None
            for doc in row["positives"]:
                if reason:
                    break
                problem = _fix(doc, resolver, status)
                reason = f"positive {doc['doc_id']}: {problem}" if problem else None
            if not reason:
                kept = []
                for doc in _distinct_negatives(row, collapsed):
                    problem = _fix(doc, resolver, status)
                    if problem:
                        removed.append({"record_id": row["record_id"], "doc_id": doc["doc_id"],
                                        "image": doc["image"], "reason": problem})
                    else:
                        kept.append(doc)
                dropped = len(row["negatives"] or []) - len(kept)
                row["negatives"] = kept
                if len(kept) < min_negatives:
                    # the full key, and why a record that listed negatives has too few: removed ones are listed
                    reason = f"fewer than data_processing.normalization.min_negatives: {len(kept)} < {min_negatives}"
                    if dropped:
                        reason += f" ({dropped} removed, each with its reason in removed_negatives)"
            if reason:
                if policy == "fail":
                    raise UnreadableData(f"record {row['record_id']}: {reason} (normalization.policy is 'fail')")
                row["reason"] = reason
                bad.append(row)
            else:
                good.append(row)
        good_batches.append(pa.RecordBatch.from_pylist(good, schema=MODEL_INPUT_SCHEMA))
        bad_batches.append(pa.RecordBatch.from_pylist(bad, schema=QUARANTINE_SCHEMA))
    if policy == "fail" and removed:
        raise UnreadableData(f"negative {removed[0]['doc_id']} of {removed[0]['record_id']}: {removed[0]['reason']}"
                             " (normalization.policy is 'fail')")
    removed = collapsed + removed
    normalized = pa.Table.from_batches(good_batches, schema=MODEL_INPUT_SCHEMA)
    quarantined = pa.Table.from_batches(bad_batches, schema=QUARANTINE_SCHEMA)
    counts = {"records_in": ingested_records.num_rows, "normalized": normalized.num_rows,
              "quarantined": quarantined.num_rows, "negatives_removed": len(removed),
              "negatives_collapsed": len(collapsed),
              "images_checked": image_manifest.num_rows,
              "images_bad": image_manifest.num_rows - int(pc.sum(image_manifest.column("ok")).as_py() or 0)}
    if counts["records_in"] != counts["normalized"] + counts["quarantined"]:
        raise AssertionError(f"count invariant broken: {counts}")
    logger.info("normalization: records_in=%d == normalized=%d + quarantined=%d; negatives removed=%d",
                counts["records_in"], counts["normalized"], counts["quarantined"], counts["negatives_removed"])
    for row in quarantined.slice(0, 5).select(["record_id", "reason"]).to_pylist():
        logger.warning("quarantined %s: %s", row["record_id"], row["reason"])
    if quarantined.num_rows > 5:
        logger.warning("... %d quarantined records in all: see quarantined_records "
                       "(data/03_primary/quarantined_records.parquet)", quarantined.num_rows)
    return normalized, quarantined, pa.Table.from_pylist(removed, schema=REMOVED_NEGATIVE_SCHEMA), counts
