"""The Qwen2.5-VL family's transformers classes: the model class and the modules the library finds inside a model.

transformers is imported by the functions, not at import (importing it takes seconds).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..base import FusedKernelTargets


def hf_modeling() -> Any:
    """transformers' Qwen2.5-VL modelling module."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf

    return hf


def model_class() -> type:
    """``Qwen2_5_VLForConditionalGeneration``."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration



def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The language model's decoder layers, in order."""
    return [m for m in model.modules() if isinstance(m, hf_modeling().Qwen2_5_VLDecoderLayer)]


def language_models(model: nn.Module) -> list[nn.Module]:
    """The ``Qwen2_5_VLTextModel`` modules inside ``model``."""
    return [m for m in model.modules() if isinstance(m, hf_modeling().Qwen2_5_VLTextModel)]


def vision_classes() -> tuple[type, type]:
    """(the vision attention class, the vision tower class)."""
    hf = hf_modeling()
    return hf.Qwen2_5_VLVisionAttention, hf.Qwen2_5_VisionTransformerPretrainedModel


def fused_kernel_targets() -> FusedKernelTargets:
    """Every RMSNorm (language model, vision blocks, merger) and the gated MLPs of the language model and of the
    vision blocks."""
    hf = hf_modeling()
    return FusedKernelTargets(hf, rms_norms=(hf.Qwen2_5_VLRMSNorm,), gated_mlps=(hf.Qwen2MLP, hf.Qwen2_5_VLMLP))
