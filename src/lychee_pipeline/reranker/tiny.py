"""``builtin:tiny`` (Qwen2.5-VL) and ``builtin:tiny-qwen3-vl`` (Qwen3-VL): tiny random-weight rerankers built
offline and deterministically, each by its family's recipe (:data:`TINY_MODELS` maps a name to its family and
folder).

No model hub is reachable in development or CI, so this module builds a miniature of
Qwen2.5-VL-7B-Instruct with the same classes, the same special tokens, the same chat template
layout and the same image processing (the recipe is the Qwen2.5-VL family's, ``families/qwen2_5_vl/recipe.py``),
and saves it with ``save_pretrained`` (safetensors) into a cache folder.
:func:`lychee_pipeline.reranker.model.load_reranker` then loads that folder through exactly the code
path it uses for a real checkpoint.

The folder carries a marker (``lychee_tiny.json``) holding the recipe version and a hash of the
recipe; it is rebuilt only when that changes. Builds go to a temporary sibling folder first and are
moved into place atomically, so concurrent processes (e.g. DDP ranks) never see half a model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

TINY_NAME = "builtin:tiny"
TINY_RECIPE_VERSION = 3
TINY_SEED = 1234
DEFAULT_TINY_DIR = Path("data/06_models/builtin_tiny")
TINY_DIR_ENV = "LYCHEE_TINY_DIR"
MARKER_FILE = "lychee_tiny.json"

# built-in name -> (its family's model_type, the suffix of its folder's name after builtin:tiny's folder name)
TINY_MODELS: dict[str, tuple[str, str]] = {
    TINY_NAME: ("qwen2_5_vl", ""),
    "builtin:tiny-qwen3-vl": ("qwen3_vl", "_qwen3_vl"),
}


def check_tiny_name(name: str) -> None:
    """A one-line error for a ``builtin:`` name that is not one of :data:`TINY_MODELS`."""
    if name not in TINY_MODELS:
        raise ValueError(f"unknown built-in model {name!r}; known: {', '.join(TINY_MODELS)}")


def recipe(name: str = TINY_NAME) -> dict[str, Any]:
    """Everything that determines the built folder (the family's tiny recipe, this version and seed)."""
    from .families import family_for

    check_tiny_name(name)
    return {"version": TINY_RECIPE_VERSION, "seed": TINY_SEED, **family_for(TINY_MODELS[name][0]).TINY_RECIPE}


def recipe_hash(name: str = TINY_NAME) -> str:
    return hashlib.sha256(json.dumps(recipe(name), sort_keys=True).encode()).hexdigest()[:16]


def tiny_dir(cache_dir: str | os.PathLike | None = None, name: str = TINY_NAME) -> Path:
    """Where a built-in model lives: ``cache_dir`` (the folder itself), else ``$LYCHEE_TINY_DIR`` or
    data/06_models/builtin_tiny for ``builtin:tiny`` and a sibling named with the model's suffix for the others."""
    check_tiny_name(name)
    if cache_dir is not None:
        return Path(cache_dir)
    base = Path(os.environ.get(TINY_DIR_ENV) or DEFAULT_TINY_DIR)
    suffix = TINY_MODELS[name][1]
    return base.with_name(base.name + suffix) if suffix else base


def _corpus() -> list[str]:
    """Training text for the tiny BPE: prompt pieces, answers, English and Chinese shop text."""
    from .prompt import DEFAULT_INSTRUCTIONS, SYSTEM_PROMPT

    lines = [SYSTEM_PROMPT, "You are a helpful assistant.", "system", "user", "assistant"]
    lines += list(DEFAULT_INSTRUCTIONS.values())
    lines += ["<Instruct>:", "<Query>:", "\n<Document>:", "Picture 1:", "Video 1:"]
    # the answers, as whole words at the start of a line (how they follow "assistant\n")
    lines += ["yes", "no", "Yes", "No"] * 50
    english = [
        "red running shoes for women with a breathable mesh upper",
        "a stainless steel water bottle that keeps drinks cold for a day",
        "wireless headphones with noise cancelling and long battery life",
        "a wooden desk lamp with a warm light and an adjustable arm",
        "cotton t-shirt in blue, size medium, machine washable",
        "leather wallet with six card slots and a coin pocket",
        "the quick brown fox jumps over the lazy dog",
        "what is the best phone case for a small budget",
        "find a picture of a black backpack with many pockets",
        "this product matches the query because it has the same colour and shape",
        "price 19.99 dollars, free shipping, 4.5 stars from 120 reviews",
        "Query Document Instruct image text relevant retrieve passage answer",
    ]
    chinese = [
        "红色女士跑步鞋，透气网面",
        "不锈钢保温水杯，保冷一整天",
        "无线降噪耳机，续航时间长",
        "木质台灯，暖光，可调节灯臂",
        "蓝色纯棉T恤，中号，可机洗",
        "真皮钱包，六个卡位和一个零钱袋",
        "请找一张有很多口袋的黑色双肩包的图片",
        "这个商品和查询的颜色、形状都一样",
        "价格十九元九角，包邮，好评率很高",
        "查询 文档 指令 图片 文本 相关 检索 是 否",
    ]
    lines += english * 8 + chinese * 8 + [str(n) for n in range(200)]
    return lines


def _build(out: Path, name: str = TINY_NAME) -> None:
    from .families import family_for

    family_for(TINY_MODELS[name][0]).build_tiny(out, _corpus(), TINY_SEED)
    (out / MARKER_FILE).write_text(
        json.dumps({"name": name, "recipe_version": TINY_RECIPE_VERSION, "recipe_hash": recipe_hash(name)}, indent=2)
    )


def is_current(folder: Path, name: str = TINY_NAME) -> bool:
    marker = folder / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return (data.get("recipe_version") == TINY_RECIPE_VERSION and data.get("recipe_hash") == recipe_hash(name)
            and data.get("name", TINY_NAME) == name)


def ensure_tiny(cache_dir: str | os.PathLike | None = None, name: str = TINY_NAME) -> Path:
    """Build the built-in model ``name`` into its cache folder if missing or stale; return the folder."""
    folder = tiny_dir(cache_dir, name).resolve()
    if is_current(folder, name):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.build-", dir=folder.parent))
    try:
        _build(tmp, name)
        if folder.exists() and not is_current(folder, name):
            stale = folder.with_name(f".{folder.name}.stale-{os.getpid()}")
            try:
                os.replace(folder, stale)
                shutil.rmtree(stale, ignore_errors=True)
            except OSError:
                pass
        try:
            os.replace(tmp, folder)
        except OSError:
            if not is_current(folder, name):  # someone else won the race with a good build: keep theirs
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder
