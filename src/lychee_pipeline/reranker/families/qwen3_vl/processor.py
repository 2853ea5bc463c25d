"""The Qwen3-VL processor: the stock ``Qwen3VLProcessor``, or a shim with only the image processor and the tokenizer
where torchvision is missing (the stock one cannot be built without its video processor, which needs torchvision);
loading (left padding) and saving (a folder the stock classes load).

The shim subclasses a transformers processor, so it is created on first use, not at import.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

STOCK_PROCESSOR = "Qwen3VLProcessor"
SHIM_NAME = "LycheeQwen3VLProcessor"


@functools.cache
def processor_shim_class() -> type:
    """:class:`LycheeQwen3VLProcessor`, created on the first call (it subclasses a transformers processor)."""
    from transformers import Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class LycheeQwen3VLProcessor(Qwen3VLProcessor):
        """Qwen3-VL processor with only the image processor and the tokenizer (images + text give the stock
        processor's inputs; videos are not taken)."""

        attributes = ["image_processor", "tokenizer"]

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            def token(name: str, default: str) -> str:
                return getattr(tokenizer, name, None) or default

            self.image_token = token("image_token", "<|image_pad|>")
            self.video_token = token("video_token", "<|video_pad|>")
            self.vision_start_token = token("vision_start_token", "<|vision_start|>")
            self.vision_end_token = token("vision_end_token", "<|vision_end|>")
            for name in ("image_token", "video_token", "vision_start_token", "vision_end_token"):
                setattr(self, f"{name}_id", tokenizer.convert_tokens_to_ids(getattr(self, name)))
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

    LycheeQwen3VLProcessor.__qualname__ = SHIM_NAME  # pickled by reference as this module's attribute
    return LycheeQwen3VLProcessor


def __getattr__(name: str) -> Any:
    if name == SHIM_NAME:
        return processor_shim_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def save_processor(processor: Any, out_dir: str | os.PathLike) -> None:
    """Save a processor so that the folder looks like a stock Qwen3-VL one (``processor_class`` the stock class)."""
    out = Path(out_dir)
    processor.save_pretrained(out)
    processor.image_processor.save_pretrained(out)  # the flat preprocessor_config.json stock folders have
    for path in out.glob("*.json"):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(data, dict) and data.get("processor_class") == SHIM_NAME:
            data["processor_class"] = STOCK_PROCESSOR
            path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def load_processor(path: str, local_files_only: bool = False) -> Any:
    """AutoProcessor where torchvision is importable, else the shim (images + text, PIL image processor)."""
    import warnings

    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    kwargs = {"trust_remote_code": False, "local_files_only": local_files_only}
    if is_torchvision_available():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            processor = AutoProcessor.from_pretrained(path, **kwargs)
    else:
        processor = processor_shim_class().from_pretrained(path, **kwargs)
    log.info("image processor: %s", type(processor.image_processor).__name__)
    if processor.tokenizer.padding_side != "left":
        processor.tokenizer.padding_side = "left"
    return processor
