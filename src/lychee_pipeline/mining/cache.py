"""A SQLite file that keeps reranker scores and image signatures between runs.

A score is keyed by a hash of the model key (model, adapter, image budget, instruction) and the pair's
content (texts, image paths with their size and modification time), so a re-run with the same model and
data rescores nothing, and a changed image or model is scored again. Image signatures are keyed by path,
size, modification time and hash size.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any


@lru_cache(maxsize=1_000_000)
def file_stamp(path: str | None) -> str:
    """``size:mtime_ns`` of a file ('' for none, '?' when it cannot be read)."""
    if not path:
        return ""
    try:
        st = os.stat(path)
    except OSError:
        return "?"
    return f"{st.st_size}:{st.st_mtime_ns}"


def _item_key(item: Mapping[str, Any] | None) -> list[str]:
    item = item or {}
    image = item.get("image")
    return [item.get("text") or "", image or "", file_stamp(image)]


def pair_key(model_key: str, query: Mapping[str, Any], doc: Mapping[str, Any]) -> str:
    """The cache key of one scored pair."""
    payload = json.dumps([model_key, _item_key(query), _item_key(doc)], ensure_ascii=False)
    return hashlib.blake2b(payload.encode("utf-8"), digest_size=16).hexdigest()


class MiningCache:
    """Scores and image signatures in one SQLite file (``None`` path: in memory, nothing kept)."""

    def __init__(self, path: str | os.PathLike | None):
        self.path = None if path is None else Path(path)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(":memory:" if self.path is None else str(self.path), timeout=60)
        self._db.execute("PRAGMA journal_mode=WAL") if self.path is not None else None
        self._db.execute("CREATE TABLE IF NOT EXISTS scores (key TEXT PRIMARY KEY, score REAL NOT NULL)")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS images (path TEXT, stamp TEXT, hash_size INTEGER, phash TEXT, "
            "r INTEGER, g INTEGER, b INTEGER, PRIMARY KEY (path, stamp, hash_size))"
        )
        self._db.commit()

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> MiningCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- scores ------------------------------------------------------------------------------------------
    def get_scores(self, keys: Sequence[str]) -> dict[str, float]:
        found: dict[str, float] = {}
        for start in range(0, len(keys), 900):  # SQLite's bound-parameter limit
            part = list(keys[start : start + 900])
            marks = ",".join("?" * len(part))
            found.update(self._db.execute(f"SELECT key, score FROM scores WHERE key IN ({marks})", part))
        return found

    def put_scores(self, items: Iterable[tuple[str, float]]) -> None:
        self._db.executemany("INSERT OR REPLACE INTO scores VALUES (?, ?)", list(items))
        self._db.commit()

    # -- image signatures -------------------------------------------------------------------------------
    def get_images(self, paths: Sequence[str], hash_size: int) -> dict[str, tuple[int, tuple[int, int, int]]]:
        found: dict[str, tuple[int, tuple[int, int, int]]] = {}
        for start in range(0, len(paths), 400):
            part = list(paths[start : start + 400])
            marks = ",".join("(?, ?)" for _ in part)
            args: list[Any] = [hash_size]
            for p in part:
                args += [p, file_stamp(p)]
            rows = self._db.execute(
                f"SELECT path, phash, r, g, b FROM images WHERE hash_size = ? AND (path, stamp) IN (VALUES {marks})",
                args,
            )
            for path, phash, r, g, b in rows:
                found[path] = (int(phash, 16), (r, g, b))
        return found

    def put_images(self, items: Mapping[str, tuple[int, tuple[int, int, int]]], hash_size: int) -> None:
        self._db.executemany(
            "INSERT OR REPLACE INTO images VALUES (?, ?, ?, ?, ?, ?, ?)",
            [(p, file_stamp(p), hash_size, format(h, "x"), *c) for p, (h, c) in items.items()],
        )
        self._db.commit()
