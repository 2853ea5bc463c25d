"""The Qwen3-VL family (``model_type: qwen3_vl``, Qwen3-VL-Reranker-2B / -8B): the names of
:class:`~lychee_pipeline.reranker.families.base.ModelFamily`, each from the module of its concern.

- ``model.py``: the transformers classes (``Qwen3VLForConditionalGeneration``, decoder layers, towers);
- ``processor.py``: the stock processor, or a shim without the video processor where torchvision is missing;
- ``prompt.py``: the Qwen3-VL-Reranker prompt (``NULL`` for an empty side, one default instruction);
- ``recipe.py``: the 2B, 8B and ``tiny`` configs, and the ``builtin:tiny-qwen3-vl`` miniature;
- ``vision.py``: the frozen tower without autograd, one attention call per image size, and selective
  checkpointing.

Packed pairs (``model.pack_pairs``, reranker/packing.py) and prefix reuse hold: the packed forward places the
DeepStack features (intermediate vision layers, added after the first decoder layers) at the packed image rows.

Scoring is the library's: sigmoid(h_last · (w_yes − w_no)) = the two-logit softmax at the last position, as the
official inference code computes it. Image tokens follow the Qwen2-VL image processor's rule (factor 32 here).
"""

from __future__ import annotations

from typing import Any

from ..qwen2_5_vl.images import image_tokens
from .model import decoder_layers, fused_kernel_targets, language_models, model_class
from .processor import load_processor, save_processor
from .prompt import DEFAULT_INSTRUCTIONS, build_messages
from .recipe import MAX_PIXELS, MIN_PIXELS, TINY_RECIPE, architecture_config, build_tiny
from .vision import apply_selective_checkpointing, disable_fast_path, enable_fast_path, vision_inputs_on_host

NAME = "qwen3_vl"
# Qwen3-VL-Reranker's processing: 4 to 1,800 visual tokens per image, 10,240 tokens per pair
PROCESSING_DEFAULTS: dict[str, int] = {"max_length": 10240, "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS}
REFUSED_FAST_PATHS: dict[str, str] = {}  # every fast path holds for Qwen3-VL

__all__ = [
    "NAME", "REFUSED_FAST_PATHS", "TINY_RECIPE", "PROCESSING_DEFAULTS", "DEFAULT_INSTRUCTIONS", "build_messages",
    "model_class", "load_processor", "save_processor", "image_tokens", "decoder_layers", "language_models",
    "architecture_config", "build_tiny", "enable_fast_path", "disable_fast_path", "vision_inputs_on_host",
    "apply_selective_checkpointing", "fused_kernel_targets",
]


def __getattr__(name: str) -> Any:
    if name == "LycheeQwen3VLProcessor":
        from .processor import processor_shim_class

        return processor_shim_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
