"""Helpers of the reliability tests: a small training table, a fast stage plan, log parsing."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

os.environ.setdefault("KEDRO_DISABLE_TELEMETRY", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

COLOURS = {"red": (220, 30, 30), "blue": (30, 60, 220), "green": (30, 170, 60)}
ITEMS = ["dress", "shirt", "shoes"]


def _doc(doc_id, text, image=None, hard=None):
    doc = {"doc_id": doc_id, "text": text, "image": image, "meta": "{}"}
    if hard is not None:
        doc["hard"] = hard
    return doc


def make_table(root, negatives: int = 5) -> pa.Table:
    """9 records in the model-input layout: text queries, image+text positives, `negatives` negatives each."""
    images = {}
    for colour, rgb in COLOURS.items():
        path = root / f"{colour}.png"
        Image.new("RGB", (56, 56), rgb).save(path)
        images[colour] = str(path)
    rows = []
    for colour in COLOURS:
        for item in ITEMS:
            others = [(c, i) for c in COLOURS for i in ITEMS if (c, i) != (colour, item)]
            rows.append({
                "record_id": f"{colour}-{item}",
                "query": {"text": f"{colour} {item}", "image": None},
                "positives": [_doc(f"{colour}-{item}", f"a {colour} {item}", images[colour])],
                "negatives": [_doc(f"{c}-{i}", f"a {c} {i}", None, hard=(c == colour))
                              for c, i in others[:negatives]],
                "task_type": "t2it",
                "language": "en",
                "split": "train",
            })
    return pa.Table.from_pylist(rows)


def stage_plan(tmp_path, gpus: int = 1, launch: dict | None = None, model: dict | None = None, **training):
    """A CPU plan of tiny, fast stages (builtin:tiny, LoRA r=4, 4 pairs per group)."""
    from lychee_pipeline.training.planning import plan_training

    base = dict(group_size=4, learning_rate=1e-3, warmup_ratio=0.0, scheduler="constant", max_steps=3,
                max_length=256, max_pixels=12544, checkpoint_every=100, keep_last=3, seed=3,
                launch={"timeout_s": 300, "process_group_timeout_s": 20, **(launch or {})})
    base.update(training)
    return plan_training({"name_or_path": "builtin:tiny", "lora": {"r": 4}, **(model or {})}, base, {}, gpus, "cpu",
                         {"name": "r", "output_root": str(tmp_path)})


def loss_lines(log_text: str) -> dict[int, float]:
    """{step: loss} from a stage's launch.log (`step 2/4 loss 0.6931 ...`)."""
    import re

    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"step (\d+)/\d+ loss ([\d.naninf-]+)", log_text)}


def read_json(path) -> dict:
    return json.loads(open(path, encoding="utf-8").read())
