"""Helpers of the training tests: the CPU plans of their stages (builtin:tiny, LoRA r=8, 4 pairs per group) and the
colour/item table with larger images. One module, so that tests of several files can share a stage run
(tests/training/conftest.py)."""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from lychee_pipeline.training.planning import plan_training
from lychee_pipeline.training.synthetic import COLOURS, write_colour_item_table

RECORDS = 24  # rows of write_colour_item_table (the training_table_path and large_image_table fixtures)

# One 1-process stage killed after step 5 resumes from checkpoint-4; the uninterrupted run of this plan is the
# reference both resume tests compare against (tests/training/conftest.py::uninterrupted_reference).
RESUME = dict(max_steps=8, checkpoint_every=4, log_every=3)
# 2 processes, accumulation 2: one epoch of the 24 records in 6 optimizer steps (conftest.py::two_process_accumulation).
ACCUMULATION = dict(gpus=2, gradient_accumulation_steps=2, max_steps=6)


def write_large_image_table(root: Path) -> str:
    """The colour/item table with 168x168 images, so a pixel budget of 56x56 vs 112x112 matters."""
    path = write_colour_item_table(root)
    for colour, rgb in COLOURS.items():  # same paths, larger images with some structure
        image = Image.new("RGB", (168, 168), rgb)
        for x in range(0, 168, 24):
            image.paste((255 - rgb[0], 255 - rgb[1], 255 - rgb[2]), (x, 0, x + 8, 168))
        image.save(root / f"{colour}.png")
    return str(path)


def worker_plan(tmp_path, gpus=1, workers=0, **training):
    """A CPU plan with a resolution ramp at half-way and `workers` DataLoader workers (builtin:tiny, LoRA r=8)."""
    base = dict(group_size=4, learning_rate=1e-3, warmup_ratio=0.25, scheduler="cosine", max_steps=None, epochs=1,
                max_length=512, min_pixels=784, max_pixels=12544, checkpoint_every=100, keep_last=3, seed=5,
                resolution_schedule=[{"start": 0.0, "max_pixels": 3136}, {"start": 0.5, "max_pixels": 12544}],
                dataloader={"num_workers": workers, "prefetch_factor": 2, "persistent_workers": True})
    base.update(training)
    return plan_training({"name_or_path": "builtin:tiny", "lora": {"r": 8}}, base, {}, gpus, "cpu",
                         {"name": "t", "output_root": str(tmp_path)})


def epoch_plan(tmp_path, gpus=1, **training):
    """A CPU plan of one epoch (max_steps null), cosine with a quarter of warm-up, seed 3."""
    base = dict(group_size=4, learning_rate=1e-3, warmup_ratio=0.25, scheduler="cosine", max_steps=None, epochs=1,
                max_length=512, max_pixels=12544, checkpoint_every=100, keep_last=3, seed=3)
    base.update(training)
    return plan_training({"name_or_path": "builtin:tiny", "lora": {"r": 8}}, base, {}, gpus, "cpu",
                         {"name": "t", "output_root": str(tmp_path)})
