"""Cached test-set scores of a model that does not change between runs (the base model).

An entry is keyed by sha256 of three parts, each recorded next to the scores in ``<key>.json``:

- **model**: a hub id as written, ``builtin:tiny`` with its recipe hash (plus a pinned ``adapter``), or for a local folder the
  sha256 of its files (relative path + bytes), so a folder rewritten in place is a different model;
- **processing**: the settings that change a score: ``max_length``, ``min_pixels``, ``max_pixels``,
  ``instructions``, ``dtype``, ``attn_implementation`` and the device type (bf16 on CUDA vs fp32 on CPU);
  never the batch size or the process count (they change scores by float rounding only, < 1e-6);
- **test split**: sha256 of the scored (query, candidate) pairs in order (texts and image paths) and of each
  image file's size and modification time, so a changed split, query sample, candidate shuffle seed or
  replaced image recomputes.

The scores are ``<key>.parquet`` (one ``score`` column, in pair order); both files are written atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

PROCESSING_KEYS = ("max_length", "min_pixels", "max_pixels", "instructions", "dtype", "attn_implementation")


def folder_hash(path: Path | str) -> str:
    """sha256 over a folder's files: relative path and bytes, in sorted order."""
    root = Path(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(root)).encode() + b"\0")
        with open(file, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()


def model_identity(name_or_path: str, adapter: str | None = None) -> dict[str, str]:
    """``{"model": id or "folder sha256:<hex>", "adapter": ...}`` (a folder is identified by its content)."""
    def one(value: str) -> str:
        if value.startswith("builtin:"):  # built from a recipe: a changed recipe is another model
            from lychee_pipeline.reranker.tiny import recipe_hash

            return f"{value} recipe {recipe_hash(value)}"
        return f"folder sha256:{folder_hash(value)}" if Path(value).is_dir() else str(value)

    out = {"model": one(str(name_or_path))}
    if adapter:
        out["adapter"] = one(str(adapter))
    return out


def processing_settings(options: Mapping[str, Any], device_type: str) -> dict[str, Any]:
    """The scoring options that change a score (see the module docstring), with the reranker's defaults."""
    from lychee_pipeline.reranker.collate import DEFAULT_MAX_LENGTH, DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS

    defaults = {"max_length": DEFAULT_MAX_LENGTH, "min_pixels": DEFAULT_MIN_PIXELS, "max_pixels": DEFAULT_MAX_PIXELS,
                "instructions": None, "dtype": "auto", "attn_implementation": "sdpa"}
    settings = {k: options.get(k, defaults[k]) for k in PROCESSING_KEYS}
    settings["device_type"] = device_type
    return settings


def pairs_hash(pairs: Sequence[Sequence[Any]]) -> str:
    """sha256 of the pairs in order, and of each image file's size and mtime (stat only, no image read)."""
    digest = hashlib.sha256()
    stats: dict[str, str] = {}

    def image(value: Any) -> str:
        if not value:
            return ""
        value = str(value)
        if value not in stats:
            try:
                st = os.stat(value)
                stats[value] = f"{value}|{st.st_size}|{st.st_mtime_ns}"
            except OSError:
                stats[value] = f"{value}|missing"
        return stats[value]

    for query, doc, *instruction in pairs:  # the instruction (when given) changes the score too
        row = [query.get("text") or "", image(query.get("image")), doc.get("text") or "", image(doc.get("image")),
               *instruction]
        digest.update(json.dumps(row).encode())
    return digest.hexdigest()


def cache_key(identity: Mapping[str, Any], processing: Mapping[str, Any], split_hash: str) -> tuple[str, dict]:
    parts = {"model": dict(identity), "processing": dict(processing), "test_pairs_sha256": split_hash}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest(), parts


class ScoreCache:
    """``lookup(key, n_pairs) -> scores | None`` and ``store(key, parts, scores)`` in one folder."""

    def __init__(self, folder: Path | str):
        self.folder = Path(folder)

    def paths(self, key: str) -> tuple[Path, Path]:
        return self.folder / f"{key}.parquet", self.folder / f"{key}.json"

    def lookup(self, key: str, n_pairs: int) -> list[float] | None:
        from lychee_pipeline.evaluation.score_shards import read_scores

        scores_path, meta_path = self.paths(key)
        if not scores_path.is_file() or not meta_path.is_file():
            return None
        try:
            scores = read_scores(scores_path)
        except Exception:  # noqa: BLE001 - a damaged entry is recomputed, never trusted
            return None
        return scores if len(scores) == n_pairs else None

    def store(self, key: str, parts: Mapping[str, Any], scores: Sequence[float], figures: Mapping[str, Any]) -> Path:
        from lychee_pipeline.evaluation.score_shards import write_scores

        scores_path, meta_path = self.paths(key)
        write_scores(scores, scores_path)
        tmp = meta_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, **parts, "pairs": len(scores), "computed": dict(figures)},
                                  indent=1, default=str))
        os.replace(tmp, meta_path)
        return scores_path
