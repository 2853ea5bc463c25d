"""The fast Qwen2.5-VL vision path, equal to the stock one up to the patch embedding's summation order: batched
attention windows, the frozen tower without autograd, the patch embedding as a matmul, and the vision tower's
grid-derived inputs computed on the host for a packed forward.

Two problems of the stock Hugging Face path (transformers 5.17 - 5.23) at the Lychee shape (8 pairs, one 448x448
image each), and what the fast path does about them (docs/benchmarks.md has the figures):

1. Vision attention, one kernel call per window. Without flash-attn, ``Qwen2_5_VLVisionAttention``
   splits the packed sequence at ``cu_seqlens`` and runs one SDPA call per window per layer (8 images
   x 16 windows x 28 window layers = 3,584 tiny calls a step), plus one ``.tolist()`` device sync per
   layer. :func:`enable_fast_path` replaces the forward of every vision attention module by one that
   groups the segments by length and runs one SDPA call per distinct length (all windows of a
   448x448 image have 64 patches: one call of batch 128 instead of 128 calls). The same attention
   function, the same scaling and the same rotary code are used; each (window, head) is still
   computed on its own, so the result equals the stock path (checked in
   ``tests/reranker/test_fast_vision.py``). The segment plan is computed once per ``cu_seqlens``
   tensor (one host sync per forward instead of one per layer).

2. The frozen vision tower recorded by autograd. Enabling activation checkpointing calls
   ``enable_input_require_grads``, which hooks every input-embedding layer, the vision tower's
   ``patch_embed`` included: the frozen tower is then recorded, checkpointed, recomputed and
   back-propagated through in every step, for gradients nobody uses. The fast path runs the vision
   tower under ``torch.no_grad()`` whenever none of its parameters requires a gradient.

3. The patch embedding as a 3-D convolution (``families/patch_embed.py``): run as the matmul it is.

Nothing here changes parameters or saved weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..base import bind_forward, frozen_no_grad_forward, restore_forward
from ..patch_embed import disable_matmul_patch_embed, enable_matmul_patch_embed
from ..segments import batched_vision_attention_forward, segment_plan
from .model import hf_modeling, vision_classes

def vision_inputs_on_host(vision_config: Any, image_grid_thw: torch.Tensor) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the vision tower derives from the image grids alone, computed on the host: ``(to the device, stays
    on the host)``, passed to its forward as precomputed keyword arguments (transformers' ``vision_utils``).

    Computed in the tower's own forward, these are Python loops over ``grid_thw.tolist()`` on a device tensor,
    each a device sync. To the device: the rotary positions and the window order. On the host: the segment
    bounds (full and windowed attention) with their segment plans built here, so the batched attention never
    reads them back, and their longest segments.
    """
    from transformers import vision_utils

    grid = image_grid_thw.cpu()
    merge = vision_config.spatial_merge_size
    window_index, cu_window_seqlens = vision_utils.get_vision_window_index(
        grid, spatial_merge_size=merge, window_size=vision_config.window_size, patch_size=vision_config.patch_size)
    cu_seqlens = vision_utils.get_vision_cu_seqlens(grid)
    for cu in (cu_seqlens, cu_window_seqlens):
        segment_plan(cu)
    to_device = {"position_ids": vision_utils.get_vision_position_ids(grid, merge), "window_index": window_index}
    on_host = {"cu_seqlens": cu_seqlens, "cu_window_seqlens": cu_window_seqlens,
               "max_seqlen": int((cu_seqlens[1:] - cu_seqlens[:-1]).max()),
               "max_window_seqlen": int((cu_window_seqlens[1:] - cu_window_seqlens[:-1]).max())}
    return to_device, on_host


@dataclass
class FastPathHandle:
    """What :func:`enable_fast_path` changed; ``disable()`` restores the stock forwards."""

    attention_modules: list[nn.Module] = field(default_factory=list)
    vision_towers: list[nn.Module] = field(default_factory=list)
    patch_embeds: list[nn.Module] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return bool(self.attention_modules or self.vision_towers or self.patch_embeds)

    def disable(self) -> None:
        for module in self.attention_modules + self.vision_towers:
            restore_forward(module)
        for module in self.patch_embeds:
            disable_matmul_patch_embed(module)
        self.attention_modules.clear()
        self.vision_towers.clear()
        self.patch_embeds.clear()


def enable_fast_path(model: nn.Module, batched_windows: bool = True, frozen_vision_no_grad: bool = True,
                     matmul_patch_embed: bool = True) -> FastPathHandle:
    """Switch every Qwen2.5-VL vision tower inside ``model`` to the fast path (idempotent).

    ``batched_windows``: one attention call per distinct window length instead of one per window.
    ``frozen_vision_no_grad``: run the vision tower under ``torch.no_grad()`` while none of its
    parameters requires a gradient (checked at every call, so unfreezing it later is safe).
    ``matmul_patch_embed``: the patch embedding's convolution as one matmul (``families/patch_embed.py``).
    Returns a :class:`FastPathHandle`; ``handle.disable()`` restores the stock forwards.
    Works on a :class:`~lychee_pipeline.reranker.model.LycheeReranker`, a peft model or a bare
    ``Qwen2_5_VLForConditionalGeneration``; modules of other architectures are left alone.
    """
    attention_cls, tower_cls = vision_classes()
    handle = FastPathHandle()
    for module in model.modules():
        if batched_windows and isinstance(module, attention_cls):
            if bind_forward(module, batched_vision_attention_forward):
                handle.attention_modules.append(module)
        elif frozen_vision_no_grad and isinstance(module, tower_cls):
            if bind_forward(module, frozen_no_grad_forward):
                handle.vision_towers.append(module)
    if matmul_patch_embed:
        handle.patch_embeds = enable_matmul_patch_embed(model, (hf_modeling().Qwen2_5_VisionPatchEmbed,))
    return handle


def disable_fast_path(model: nn.Module) -> None:
    """Undo :func:`enable_fast_path` on every module of ``model``."""
    for module in model.modules():
        restore_forward(module)
    disable_matmul_patch_embed(model)

