"""A vision tower's patch embedding as one matmul: both families' ``PatchEmbed.proj`` is an ``nn.Conv3d`` whose stride
equals its kernel, so each output is one patch's pixel row dotted with one filter (Qwen2.5-VL's fast path uses it;
Qwen3-VL's keeps the convolution: ``qwen3_vl/vision.py`` says why).

The pixel rows arrive flattened already ([patches, channels x temporal x patch x patch], in the order the
convolution's weight is laid out), so ``F.linear`` on the weight viewed as [embed, channels x temporal x patch x
patch] computes the same products without reshaping the rows into 5-D volumes. Why: cuDNN picks its 3-D convolution
kernels by heuristics that have regressed across releases for exactly this shape (a 10-20x slower vision forward
reported on PyTorch 2.9, pytorch/pytorch#166122 and #174051; transformers added the same rewrite as an opt-in,
huggingface/transformers#45041), while a matmul of [patches, 1176] x [1176, 1280] always goes to cuBLAS. The weights,
their names and the saved checkpoint are untouched; the forward is bound on the instance and can be restored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import bind_forward, restore_forward

STOCK_FORWARD = "_lychee_stock_patch_embed_forward"


def is_patchwise_conv(conv: nn.Module) -> bool:
    """Whether ``conv`` is a 3-D convolution that maps each non-overlapping patch on its own (stride == kernel, no
    padding, dilation or groups): then it is a matmul over the flattened patch."""
    if not isinstance(conv, nn.Conv3d) or isinstance(conv.padding, str):
        return False
    return (tuple(conv.stride) == tuple(conv.kernel_size) and all(p == 0 for p in conv.padding)
            and all(d == 1 for d in conv.dilation) and conv.groups == 1)


def patch_embed_as_matmul(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``PatchEmbed.forward`` of both families (rows of one patch's pixels in, [patches, embed] out) as a matmul."""
    weight = self.proj.weight  # [embed, channels, temporal, patch, patch]
    rows = hidden_states.reshape(-1, weight[0].numel()).to(weight.dtype)
    return F.linear(rows, weight.reshape(weight.shape[0], -1), self.proj.bias)


def enable_matmul_patch_embed(model: nn.Module, embed_classes: tuple[type, ...]) -> list[nn.Module]:
    """Bind :func:`patch_embed_as_matmul` on every ``embed_classes`` module of ``model`` whose ``proj`` is a
    patch-wise convolution (idempotent); returns the modules switched now."""
    return [module for module in model.modules()
            if isinstance(module, embed_classes) and is_patchwise_conv(getattr(module, "proj", None))
            and bind_forward(module, patch_embed_as_matmul, STOCK_FORWARD)]


def disable_matmul_patch_embed(model: nn.Module) -> int:
    """The stock convolution forward again on every module :func:`enable_matmul_patch_embed` switched."""
    return sum(restore_forward(module, STOCK_FORWARD) for module in model.modules())
