"""The Qwen3-VL family's transformers classes: the model class and the modules the library finds inside a model.

transformers is imported by the functions, not at import (importing it takes seconds).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..base import FusedKernelTargets


def hf_modeling() -> Any:
    """transformers' Qwen3-VL modelling module."""
    from transformers.models.qwen3_vl import modeling_qwen3_vl as hf

    return hf


def model_class() -> type:
    """``Qwen3VLForConditionalGeneration``."""
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The language model's decoder layers, in order."""
    return [m for m in model.modules() if isinstance(m, hf_modeling().Qwen3VLTextDecoderLayer)]


def language_models(model: nn.Module) -> list[nn.Module]:
    """The ``Qwen3VLTextModel`` modules inside ``model``."""
    return [m for m in model.modules() if isinstance(m, hf_modeling().Qwen3VLTextModel)]


def vision_towers(model: nn.Module) -> list[nn.Module]:
    """The ``Qwen3VLVisionModel`` modules inside ``model`` (their DeepStack mergers included)."""
    return [m for m in model.modules() if isinstance(m, hf_modeling().Qwen3VLVisionModel)]


def fused_kernel_targets() -> FusedKernelTargets:
    """The language model's RMSNorms (the per-head q/k norms among them) and its gated MLPs. The vision tower's
    norms are LayerNorms and its MLPs plain GELU ones: they keep their modules (its rotary takes liger's kernel)."""
    hf = hf_modeling()
    return FusedKernelTargets(hf, rms_norms=(hf.Qwen3VLTextRMSNorm,), gated_mlps=(hf.Qwen3VLTextMLP,))
