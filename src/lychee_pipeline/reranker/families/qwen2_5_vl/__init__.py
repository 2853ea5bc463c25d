"""The Qwen2.5-VL family (``model_type: qwen2_5_vl``, Lychee-rerank-mm): the names of
:class:`~lychee_pipeline.reranker.families.base.ModelFamily`, each from the module of its concern.

- ``model.py``: the transformers classes (the model class, decoder layers, language models, vision classes);
- ``processor.py``: the stock processor or the shim :class:`LycheeProcessor` where torchvision is missing; saving;
- ``images.py``: how many tokens an image becomes under a pixel budget (the processor's resize rule);
- ``recipe.py``: the 7B and ``tiny`` configs from one table, and the ``builtin:tiny`` miniature built from it;
- ``fast_vision.py``: batched vision windows, the frozen tower without autograd, the tower's host-side inputs;
- ``checkpointing.py``: checkpointing of the first k decoder layers, and k from a memory budget.

Importing this package costs torch only; transformers is imported by the functions that use it.
"""

from __future__ import annotations

from typing import Any

from .checkpointing import apply_selective_checkpointing
from .fast_vision import disable_fast_path, enable_fast_path, vision_inputs_on_host
from .images import image_tokens
from .model import decoder_layers, fused_kernel_targets, language_models, model_class
from .processor import load_processor, save_processor
from .recipe import TINY_RECIPE, architecture_config, build_tiny

from ...collate import DEFAULT_MAX_LENGTH, DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS
from ...prompt import DEFAULT_INSTRUCTIONS, build_messages

NAME = "qwen2_5_vl"
PROCESSING_DEFAULTS: dict[str, int] = {"max_length": DEFAULT_MAX_LENGTH, "min_pixels": DEFAULT_MIN_PIXELS,
                                       "max_pixels": DEFAULT_MAX_PIXELS}
REFUSED_FAST_PATHS: dict[str, str] = {}  # every fast path holds for Qwen2.5-VL

__all__ = [
    "NAME", "REFUSED_FAST_PATHS", "TINY_RECIPE", "PROCESSING_DEFAULTS", "DEFAULT_INSTRUCTIONS", "build_messages", "model_class", "load_processor", "save_processor", "image_tokens",
    "decoder_layers", "language_models", "architecture_config", "build_tiny", "enable_fast_path",
    "disable_fast_path", "vision_inputs_on_host", "apply_selective_checkpointing", "fused_kernel_targets",
]


def __getattr__(name: str) -> Any:
    # LycheeProcessor subclasses a transformers processor: created on first use (importing it takes seconds)
    if name == "LycheeProcessor":
        from .processor import processor_shim_class

        return processor_shim_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
