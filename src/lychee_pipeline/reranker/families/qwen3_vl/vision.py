"""The Qwen3-VL family's fast path and checkpointing.

- :func:`enable_fast_path`: a frozen vision tower (and its DeepStack mergers) runs without autograd — the same
  numbers as the stock forward, without keeping its activations. Batched attention windows (Qwen2.5-VL's fast
  vision path) do not apply: Qwen3-VL's tower attends over whole images, one call per image already.
- :func:`apply_selective_checkpointing`: the first k decoder layers, never a frozen tower (Qwen2.5-VL's rule).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from ..base import transformers_model
from ..qwen2_5_vl.checkpointing import checkpoint_first_layers
from .model import decoder_layers, vision_towers

_FAST_ATTR = "_lychee_frozen_without_autograd"


def _frozen(tower: nn.Module) -> bool:
    return not any(p.requires_grad for p in tower.parameters())


def enable_fast_path(model: nn.Module) -> nn.Module:
    """Run each vision tower under ``torch.no_grad`` while none of its parameters trains (checked at every call, so
    a tower unfrozen later trains as usual); idempotent."""
    for tower in vision_towers(transformers_model(model)):
        if getattr(tower, _FAST_ATTR, False):
            continue
        stock = tower.forward

        @functools.wraps(stock)
        def forward(*args: Any, _stock=stock, _tower=tower, **kwargs: Any) -> Any:
            if _frozen(_tower):
                with torch.no_grad():
                    return _stock(*args, **kwargs)
            return _stock(*args, **kwargs)

        tower.forward = forward
        setattr(tower, _FAST_ATTR, True)
    return model


def disable_fast_path(model: nn.Module) -> nn.Module:
    """Back to the stock tower forward (the benchmarks switch variants on one model)."""
    for tower in vision_towers(transformers_model(model)):
        if getattr(tower, _FAST_ATTR, False):
            del tower.forward
            setattr(tower, _FAST_ATTR, False)
    return model


def vision_inputs_on_host(vision_config: Any, image_grid_thw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tower's grid-derived inputs a packed batch prepares on the host: none (Qwen3-VL's tower attends over whole
    images and derives its positions itself; Qwen2.5-VL's window indices have no counterpart here)."""
    return {}, {}


def apply_selective_checkpointing(model: nn.Module, layers: int | float | None = None) -> int:
    """Activation checkpointing (non-reentrant) of the first ``layers`` Qwen3-VL decoder layers (a count, a fraction
    in [0, 1], ``None`` for all, ``0`` off); a frozen vision tower's blocks are never checkpointed."""
    hf_model = transformers_model(model)
    return checkpoint_first_layers(hf_model, decoder_layers(hf_model), vision_towers(hf_model), layers)
