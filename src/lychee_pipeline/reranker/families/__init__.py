"""Model families: what the reranker library needs from one backbone architecture, behind one small interface.

A family is a module that provides the functions of :class:`ModelFamily`; :func:`family_for` finds it by the
``model_type`` of a checkpoint's ``config.json``. Everything specific to an architecture (its transformers
classes, processor, image sizing, fast paths, the miniature built as ``builtin:tiny``) lives in its module;
``load_reranker``, the collators and ``builtin:tiny`` reach it only through these functions.

Adding a family: a module here with the same functions, and its model types in :data:`FAMILIES`.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any, Protocol

# model_type (config.json) -> the module of its family, imported on first use
FAMILIES = {"qwen2_5_vl": "qwen2_5_vl"}


class ModelFamily(Protocol):
    """The functions a family module provides (a module satisfies this protocol structurally)."""

    def model_class(self) -> type:
        """The transformers class a checkpoint is loaded with (``from_pretrained``, safetensors only)."""

    def load_processor(self, path: str, local_files_only: bool = False) -> Any:
        """The processor of a saved folder or hub id, left padding."""

    def save_processor(self, processor: Any, out_dir: str | os.PathLike) -> None:
        """Save a processor so that the folder loads with the stock classes."""

    def image_tokens(self, processor: Any, height: int, width: int, min_pixels: int, max_pixels: int) -> int:
        """Language-model tokens one image of this size becomes under the pixel budget."""

    def enable_fast_path(self, model: Any) -> Any:
        """Switch the model to the family's faster, numerically equal forward (idempotent)."""

    def apply_selective_checkpointing(self, model: Any, layers: int | float | None = None) -> int:
        """Activation checkpointing of the first ``layers`` decoder layers; returns how many."""

    def decoder_layers(self, model: Any) -> list[Any]:
        """The language model's decoder layers, in order."""

    def architecture_config(self, size: str, vocab_size: int | None = None, token_ids: dict | None = None) -> Any:
        """The transformers config of a published size, or ``"tiny"``: the miniature ``builtin:tiny`` is built with."""

    def build_tiny(self, out: Path, corpus: list[str], seed: int) -> None:
        """Write the random-weight miniature (weights, tokenizer trained on ``corpus``, processor) into ``out``."""


def family_for(model_type: str) -> ModelFamily:
    """The family of a ``model_type``; an unknown one is a one-line error naming the known ones."""
    module = FAMILIES.get(model_type)
    if module is None:
        raise ValueError(f"no model family for model_type {model_type!r}; known: {', '.join(sorted(FAMILIES))}")
    return importlib.import_module(f"{__name__}.{module}")


def family_of(path: str, local_files_only: bool = False) -> ModelFamily:
    """The family of a local model folder or a hub id, from the ``model_type`` of its config.json."""
    config_file = Path(path) / "config.json"
    if config_file.is_file():
        model_type = json.loads(config_file.read_text()).get("model_type")
    else:
        from transformers import PretrainedConfig

        model_type = PretrainedConfig.get_config_dict(path, local_files_only=local_files_only)[0].get("model_type")
    return family_for(str(model_type))
