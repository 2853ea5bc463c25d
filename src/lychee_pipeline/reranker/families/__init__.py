"""Model families: what the reranker library needs from one backbone architecture, behind one interface.

A family is a module or package here that provides the names of :class:`~.base.ModelFamily` (the contract, in
``base.py``); :func:`family_for` finds it by the ``model_type`` of a checkpoint's ``config.json``,
:func:`family_of_model` by that of a loaded model. Everything specific to an architecture (its transformers
classes, processor, image sizing, fast paths, the miniature built as ``builtin:tiny``) lives in its module;
``load_reranker``, the collators, packing, kernels and ``builtin:tiny`` reach it only through these names. A fast
path that does not hold for a family is refused by the family (``REFUSED_FAST_PATHS``), with its reason.

Adding a family: one module here providing the names of ``ModelFamily``, and its model types in :data:`FAMILIES`.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from .base import FAST_PATHS, FusedKernelTargets, ModelFamily, contract_names, refused, require_fast_path, transformers_model

__all__ = ["FAMILIES", "DEFAULT_FAMILY", "FAST_PATHS", "FusedKernelTargets", "ModelFamily", "contract_names", "family_for", "family_of", "family_of_model",
           "refused", "require_fast_path"]

# model_type (config.json) -> the module of its family, imported on first use
FAMILIES = {"qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl"}
# the family of builtin:tiny, and of collators made without a model (a processor alone does not say)
DEFAULT_FAMILY = "qwen2_5_vl"


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


def family_of_model(model: Any) -> ModelFamily:
    """The family of a loaded model (a LycheeReranker, a peft model, a transformers model or a part of one that is
    a transformers model), from the ``model_type`` of its outermost transformers model's config."""
    return family_for(str(transformers_model(model).config.model_type))
