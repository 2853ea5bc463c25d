"""The Qwen2.5-VL processor: the stock one, or the shim :class:`LycheeProcessor` where torchvision is missing;
loading (left padding, the image processor kind logged) and saving (a folder the stock classes load).

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


@functools.cache
def processor_shim_class() -> type:
    """:class:`LycheeProcessor`, created on the first call (it subclasses a transformers processor)."""
    from transformers import Qwen2_5_VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class LycheeProcessor(Qwen2_5_VLProcessor):
        """Qwen2.5-VL processor with only the image processor and the tokenizer.

        Used where torchvision is missing: transformers' video processor needs it, and the stock
        processor cannot be built without one. Images + text produce the same inputs as the stock one.
        """

        attributes = ["image_processor", "tokenizer"]  # read by older transformers; newer ones use __init__

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
            self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
            self.image_token_id = getattr(tokenizer, "image_token_id", None) or tokenizer.convert_tokens_to_ids(
                self.image_token
            )
            self.video_token_id = getattr(tokenizer, "video_token_id", None) or tokenizer.convert_tokens_to_ids(
                self.video_token
            )
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

    LycheeProcessor.__qualname__ = "LycheeProcessor"  # pickled by reference as this module's attribute
    return LycheeProcessor


def __getattr__(name: str) -> Any:
    # LycheeProcessor subclasses a transformers processor: created on first use (importing it takes seconds)
    if name == "LycheeProcessor":
        return processor_shim_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def save_processor(processor: Any, out_dir: str | os.PathLike) -> None:
    """Save a processor so that the folder looks like a stock Qwen2.5-VL one."""
    out = Path(out_dir)
    processor.save_pretrained(out)
    # the legacy flat image-processor file, as stock Qwen2.5-VL folders have it: transformers builds the
    # video processor from it when torchvision is installed (and older releases read only this file)
    processor.image_processor.save_pretrained(out)
    for path in out.glob("*.json"):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(data, dict) and data.get("processor_class") == "LycheeProcessor":
            data["processor_class"] = "Qwen2_5_VLProcessor"
            path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def image_processor_kind(processor: Any) -> str:
    """``"fast"`` when the processor resizes and normalises with torchvision (tensor ops, the faster host path),
    ``"pil"`` for the PIL/numpy one (what a machine without torchvision gets)."""
    names = {cls.__name__ for cls in type(processor.image_processor).__mro__}
    fast = any(n.endswith("Fast") for n in names) or "TorchvisionBackend" in names
    return "fast" if fast else "pil"


def load_processor(path: str, local_files_only: bool = False) -> Any:
    """AutoProcessor with the fast (torchvision) image processor when torchvision is importable, else
    :class:`LycheeProcessor` (images + text, PIL image processor). Which one loaded is logged."""
    import warnings

    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    kwargs = {"trust_remote_code": False, "local_files_only": local_files_only}
    if is_torchvision_available():
        with warnings.catch_warnings():  # newer transformers: fast is the default and the flag is deprecated
            warnings.simplefilter("ignore")
            processor = AutoProcessor.from_pretrained(path, use_fast=True, **kwargs)
    else:
        processor = processor_shim_class().from_pretrained(path, **kwargs)
    log.info("image processor: %s (%s)", type(processor.image_processor).__name__, image_processor_kind(processor))
    tok = processor.tokenizer
    if tok.padding_side != "left":
        tok.padding_side = "left"
    return processor



def image_processor_class() -> type:
    """The PIL/numpy Qwen2-VL image processor class of this transformers (what builtin:tiny saves)."""
    import transformers

    # transformers >= 5.2x names the PIL backend *Pil; older 5.x has the PIL/numpy class unsuffixed.
    for name in ("Qwen2VLImageProcessorPil", "Qwen2VLImageProcessor"):
        cls = getattr(transformers, name, None)
        if cls is not None:
            try:
                cls()
            except ImportError:
                continue
            return cls
    raise ImportError("no usable Qwen2-VL image processor class in this transformers")

