"""A small learnable model-input table with real PNG images, for stage checks on a new machine and tests."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

COLOURS = {"red": (220, 30, 30), "blue": (30, 60, 220), "green": (30, 170, 60), "yellow": (230, 210, 40)}
ITEMS = ["dress", "shirt", "shoes", "bag"]


def _doc(doc_id: str, text: str, image: str | None = None, hard: bool | None = None) -> dict:
    doc = {"doc_id": doc_id, "text": text, "image": image, "meta": json.dumps({"popularity": 1})}
    if hard is not None:
        doc["hard"] = hard
    return doc


def write_colour_item_table(root: Path) -> Path:
    """24 records in the model-input schema: query 'red dress' -> 'a red dress' (+ image), 9 negatives each."""
    root.mkdir(parents=True, exist_ok=True)
    images = {}
    for colour, rgb in COLOURS.items():
        path = root / f"{colour}.png"
        Image.new("RGB", (56, 56), rgb).save(path)
        images[colour] = str(path.resolve())
    rows = []
    for colour in COLOURS:
        for item in ITEMS:
            others = [(c, i) for c in COLOURS for i in ITEMS if (c, i) != (colour, item)]
            negatives = [
                _doc(f"{c}-{i}", f"a {c} {i}", images[c] if n % 2 else None, hard=(c == colour or i == item))
                for n, (c, i) in enumerate(others[:9])
            ]
            rows.append({
                "record_id": f"{colour}-{item}",
                "query": {"text": f"{colour} {item}", "image": None},
                "positives": [_doc(f"{colour}-{item}", f"a {colour} {item}", images[colour])],
                "negatives": negatives,
                "task_type": "t2it",
                "language": "en",
                "split": "train",
            })
    rows = rows + [dict(r, record_id=r["record_id"] + "-b") for r in rows[:8]]
    path = root / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
