"""The Qwen3-VL family's fast path and checkpointing.

- :func:`enable_fast_path`: a frozen vision tower (and its DeepStack mergers) runs without autograd — the same
  numbers as the stock forward, without keeping its activations; its attention, over whole images (one SDPA call
  per image in the stock forward), runs one call per distinct image size (Qwen2.5-VL's batched segments; the
  same features, bit for bit, on one H100). The patch embedding stays a convolution here: as a matmul it paid 4%
  of the 2B tower's time, and the tiny model's smoke run, whose lift is sensitive to the last bit of its inputs,
  then fell below the end-to-end test's margin (docs/benchmarks.md, 2026-12-06).
- :func:`apply_selective_checkpointing`: the first k decoder layers, never a frozen tower (Qwen2.5-VL's rule).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..base import bind_forward, frozen_no_grad_forward, restore_forward, transformers_model
from ..qwen2_5_vl.checkpointing import checkpoint_first_layers
from ..segments import batched_vision_attention_forward, segment_plan
from .model import decoder_layers, hf_modeling, vision_towers

def enable_fast_path(model: nn.Module) -> nn.Module:
    """Run each vision tower under ``torch.no_grad`` while none of its parameters trains (checked at every call, so
    a tower unfrozen later trains as usual) and its attention one call per image size; idempotent."""
    hf = hf_modeling()
    for module in transformers_model(model).modules():
        if isinstance(module, hf.Qwen3VLVisionModel):
            bind_forward(module, frozen_no_grad_forward)
        elif isinstance(module, hf.Qwen3VLVisionAttention):
            bind_forward(module, batched_vision_attention_forward)
    return model


def disable_fast_path(model: nn.Module) -> nn.Module:
    """Back to the stock tower forward (the benchmarks switch variants on one model)."""
    for module in transformers_model(model).modules():
        restore_forward(module)
    return model


def vision_inputs_on_host(vision_config: Any, image_grid_thw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the tower derives from the image grids alone, computed on the host: ``(to the device, stays on the
    host)``, passed to its forward as precomputed keyword arguments (transformers' ``vision_utils``).

    Left to the tower, these come from the grids on the device: its position-embedding resampling then reads
    device values back (``repeat_interleave`` without a known size), and with the grids on the host its lookup
    indexes a device table by a host tensor ("index is on cpu", the first CUDA run of a packed Qwen3-VL batch).
    To the device: the resampling's taps and weights and the rotary positions. On the host: each image's bounds
    with their same-size groups (the batched SDPA attention; flash attention reads them on the device) and the
    longest.
    """
    from transformers import vision_utils
    from transformers.utils.generic import is_flash_attention_requested

    grid = image_grid_thw.cpu()
    merge = vision_config.spatial_merge_size
    # the tower's resampling of its square learned table: bilinear, corners aligned (Qwen3VLVisionModel.__init__)
    indices, weights = vision_utils.get_vision_interpolation_indices_and_weights(
        grid, num_grid_per_side=int(vision_config.num_position_embeddings ** 0.5), mode="bilinear",
        align_corners=True, spatial_merge_size=merge)
    cu_seqlens = vision_utils.get_vision_cu_seqlens(grid)
    to_device = {"interp_indices": indices, "interp_weights": weights,
                 "position_ids": vision_utils.get_vision_position_ids(grid, merge)}
    on_host = {"max_seqlen": int((cu_seqlens[1:] - cu_seqlens[:-1]).max())}
    if is_flash_attention_requested(vision_config):
        to_device["cu_seqlens"] = cu_seqlens
    else:  # the batched attention's same-size groups, planned here so no layer reads the bounds back
        segment_plan(cu_seqlens)
        on_host["cu_seqlens"] = cu_seqlens
    return to_device, on_host


def apply_selective_checkpointing(model: nn.Module, layers: int | float | None = None) -> int:
    """Activation checkpointing (non-reentrant) of the first ``layers`` Qwen3-VL decoder layers (a count, a fraction
    in [0, 1], ``None`` for all, ``0`` off); a frozen vision tower's blocks are never checkpointed."""
    hf_model = transformers_model(model)
    return checkpoint_first_layers(hf_model, decoder_layers(hf_model), vision_towers(hf_model), layers)
