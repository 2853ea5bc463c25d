"""Selective activation checkpointing for the Qwen2.5-VL family: the first k decoder layers only (memory for
speed), never the frozen vision tower; :func:`checkpoint_layers_for_budget` picks k from a memory budget.

Only the two classes it looks for are the family's (:func:`~.model.decoder_layers`, the vision tower class):
:func:`checkpoint_first_layers` is the rule itself, for any transformers model.
"""

from __future__ import annotations

import math

from torch import nn

from ..base import transformers_model
from .model import decoder_layers, vision_classes


def apply_selective_checkpointing(model: nn.Module, layers: int | float | None = None) -> int:
    """Activation checkpointing (non-reentrant) on the first ``layers`` Qwen2.5-VL decoder layers only.

    ``layers``: a count (int), a fraction in [0, 1] of the decoder layers (float), or ``None`` for all of them;
    ``0`` turns checkpointing off. The vision tower's blocks are never checkpointed when the tower is
    frozen (it runs without autograd on the fast path). Returns the number of checkpointed decoder layers.
    """
    hf_model = transformers_model(model)
    _, tower_cls = vision_classes()
    towers = [m for m in hf_model.modules() if isinstance(m, tower_cls)]
    return checkpoint_first_layers(hf_model, decoder_layers(hf_model), towers, layers)


def checkpoint_first_layers(hf_model: nn.Module, layer_list: list[nn.Module], vision_towers: list[nn.Module],
                            layers: int | float | None) -> int:
    """The rule of :func:`apply_selective_checkpointing` for a transformers model, its decoder layers in order and
    its vision towers. Uses the stock transformers switch first, so every layer gets the same checkpoint function
    as with plain checkpointing, then clears the flag of the layers that keep their activations and of the
    blocks of a frozen tower."""
    n = len(layer_list)
    if layers is None:
        k = n
    elif isinstance(layers, float):
        if not 0.0 <= layers <= 1.0:
            raise ValueError(f"a fraction of layers must be in [0, 1], got {layers}")
        k = int(math.ceil(layers * n))
    else:
        k = int(layers)
    k = max(0, min(n, k))
    if k == 0:
        if hasattr(hf_model, "activation_checkpointing_disable"):
            hf_model.activation_checkpointing_disable()
        else:
            hf_model.gradient_checkpointing_disable()
        return 0
    kwargs = {"use_reentrant": False}
    if getattr(hf_model, "_require_grads_hooks", None) and hasattr(hf_model, "disable_input_require_grads"):
        hf_model.disable_input_require_grads()  # enabling again would stack a second set of hooks
    if hasattr(hf_model, "activation_checkpointing_enable"):
        hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if hasattr(hf_model, "config"):
        hf_model.config.use_cache = False
    for i, layer in enumerate(layer_list):
        layer.gradient_checkpointing = i < k
    for tower in vision_towers:
        if not any(p.requires_grad for p in tower.parameters()):
            for block in tower.modules():
                if hasattr(block, "gradient_checkpointing"):
                    block.gradient_checkpointing = False
    return k


def checkpoint_layers_for_budget(
    num_layers: int,
    tokens: int,
    budget_bytes: float,
    fixed_bytes: float,
    bytes_per_token_layer: float,
    checkpointed_bytes_per_token_layer: float = 0.0,
) -> int:
    """Fewest checkpointed decoder layers that keep the step under ``budget_bytes``.

    Model: peak = fixed + tokens * (kept * per_layer + checkpointed * per_checkpointed_layer), where
    ``fixed_bytes`` holds weights, optimizer state and the recompute of one layer, ``tokens`` is the
    padded token count of a micro-batch (batch x longest row), and the per-token-per-layer costs
    come from a measurement (``benchmarks/train_step.py`` prints them).
    """
    if bytes_per_token_layer <= checkpointed_bytes_per_token_layer:
        return 0
    room = budget_bytes - fixed_bytes - tokens * num_layers * checkpointed_bytes_per_token_layer
    kept = int(room // (tokens * (bytes_per_token_layer - checkpointed_bytes_per_token_layer)))
    return max(0, min(num_layers, num_layers - kept))
