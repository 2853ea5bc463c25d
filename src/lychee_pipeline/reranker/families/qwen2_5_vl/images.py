"""Image sizing of the Qwen2.5-VL family: how many language-model tokens an image becomes under a pixel budget."""

from __future__ import annotations

from typing import Any


def image_tokens(processor: Any, height: int, width: int, min_pixels: int, max_pixels: int) -> int:
    """LM tokens one image of ``height`` x ``width`` becomes under the pixel budget (the processor's own rule:
    resized to a multiple of patch x merge within the budget, one token per merge x merge patches)."""
    ip = processor.image_processor
    merge = int(getattr(ip, "merge_size", 2))
    budget = {"min_pixels": min_pixels, "max_pixels": max_pixels}
    if hasattr(ip, "get_number_of_image_patches"):
        patches = ip.get_number_of_image_patches(height, width, budget)
    else:  # pragma: no cover - very old processors; the processor check in PairCollator.encode guards this
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        patch = int(getattr(ip, "patch_size", 14))
        h, w = smart_resize(height, width, patch * merge, **budget)
        patches = (h // patch) * (w // patch)
    return int(patches) // (merge**2)

