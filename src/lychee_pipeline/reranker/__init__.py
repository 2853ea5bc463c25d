"""Kedro-free reranker library: Lychee-rerank-mm prompt, model loading, collators, losses, inference.

Names are imported lazily, so ``import lychee_pipeline.reranker.prompt`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SYSTEM_PROMPT": "prompt",
    "DEFAULT_INSTRUCTIONS": "prompt",
    "build_messages": "prompt",
    "task_type_of": "prompt",
    "ModelConfig": "model",
    "load_reranker": "model",
    "LycheeReranker": "model",
    "PairCollator": "collate",
    "GroupCollator": "collate",
    "sample_group": "collate",
    "max_pixels_at": "collate",
    "pointwise_loss": "losses",
    "listwise_loss": "losses",
    "LossOptions": "losses",
    "get_loss": "losses",
    "register_loss": "losses",
    "Reranker": "inference",
    "ProcessingConfig": "processing",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
