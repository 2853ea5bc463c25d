"""``builtin:tiny``: a tiny random-weight Qwen2.5-VL reranker built offline and deterministically.

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


def recipe() -> dict[str, Any]:
    """Everything that determines the built folder (the family's tiny recipe, this version and seed)."""
    from .families import DEFAULT_FAMILY, family_for

    return {"version": TINY_RECIPE_VERSION, "seed": TINY_SEED, **family_for(DEFAULT_FAMILY).TINY_RECIPE}


def recipe_hash() -> str:
    return hashlib.sha256(json.dumps(recipe(), sort_keys=True).encode()).hexdigest()[:16]


def tiny_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where ``builtin:tiny`` lives: ``cache_dir``, else ``$LYCHEE_TINY_DIR``, else data/06_models/builtin_tiny."""
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get(TINY_DIR_ENV) or DEFAULT_TINY_DIR)


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


def _build(out: Path) -> None:
    from .families import DEFAULT_FAMILY, family_for

    family_for(DEFAULT_FAMILY).build_tiny(out, _corpus(), TINY_SEED)
    (out / MARKER_FILE).write_text(
        json.dumps({"name": TINY_NAME, "recipe_version": TINY_RECIPE_VERSION, "recipe_hash": recipe_hash()}, indent=2)
    )


def is_current(folder: Path) -> bool:
    marker = folder / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return data.get("recipe_version") == TINY_RECIPE_VERSION and data.get("recipe_hash") == recipe_hash()


def ensure_tiny(cache_dir: str | os.PathLike | None = None) -> Path:
    """Build ``builtin:tiny`` into its cache folder if missing or stale; return the folder."""
    folder = tiny_dir(cache_dir).resolve()
    if is_current(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.build-", dir=folder.parent))
    try:
        _build(tmp)
        if folder.exists() and not is_current(folder):
            stale = folder.with_name(f".{folder.name}.stale-{os.getpid()}")
            try:
                os.replace(folder, stale)
                shutil.rmtree(stale, ignore_errors=True)
            except OSError:
                pass
        try:
            os.replace(tmp, folder)
        except OSError:
            if not is_current(folder):  # someone else won the race with a good build: keep theirs
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder
