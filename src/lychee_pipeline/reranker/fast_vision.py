"""A faster training/inference path for the Qwen2.5-VL reranker, numerically equal to the stock one.

Two problems of the stock Hugging Face path (transformers 5.17 - 5.23) at the Lychee shape (8 pairs,
one 448x448 image each), and what this module does about them:

1. **Vision attention, one kernel call per window.** Without flash-attn, ``Qwen2_5_VLVisionAttention``
   splits the packed sequence at ``cu_seqlens`` and runs one SDPA call per window per layer (8 images
   x 16 windows x 28 window layers = 3,584 tiny calls a step), plus one ``.tolist()`` device sync per
   layer. :func:`enable_fast_path` replaces the forward of every vision attention module by one that
   groups the segments by length and runs **one** SDPA call per distinct length (all windows of a
   448x448 image have 64 patches: one call of batch 128 instead of 128 calls). The same attention
   function, the same scaling and the same rotary code are used; each (window, head) is still
   computed on its own, so the result equals the stock path (checked in
   ``tests/reranker/test_fast_vision.py``). The segment plan is computed once per ``cu_seqlens``
   tensor (one host sync per forward instead of one per layer).

2. **The frozen vision tower recorded by autograd.** Enabling activation checkpointing calls
   ``enable_input_require_grads``, which hooks *every* input-embedding layer, the vision tower's
   ``patch_embed`` included: the frozen tower is then recorded, checkpointed, recomputed and
   back-propagated through in every step, for gradients nobody uses. The fast path runs the vision
   tower under ``torch.no_grad()`` whenever none of its parameters requires a gradient.

:func:`apply_selective_checkpointing` checkpoints only some of the language model's decoder layers
(memory for speed), and :func:`checkpoint_layers_for_budget` picks that number from a memory budget.

Usage (the training loop / ``load_reranker``)::

    from lychee_pipeline.reranker.fast_vision import enable_fast_path, apply_selective_checkpointing
    enable_fast_path(model)                          # any module holding a Qwen2.5-VL (LycheeReranker, peft, HF)
    apply_selective_checkpointing(model, layers=k)   # instead of checkpointing all layers

Only torch and transformers are needed; nothing here changes parameters or saved weights.
"""

from __future__ import annotations

import math
import types
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

_PLAN_ATTR = "_lychee_segment_plan"
_ORIG_FORWARD = "_lychee_orig_forward"


# ----------------------------------------------------------------------------------------------
# segment plan: which rows of the packed sequence form same-length groups


@dataclass
class _Group:
    length: int  # tokens per segment
    count: int  # segments in the group
    start: int | None  # first row, when the group's segments are one contiguous run
    index: torch.Tensor | None  # row indices [count * length] otherwise (on the device)


def _build_plan(cu_seqlens: torch.Tensor) -> list[_Group]:
    bounds = [int(b) for b in cu_seqlens.tolist()]
    by_length: OrderedDict[int, list[int]] = OrderedDict()
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi > lo:
            by_length.setdefault(hi - lo, []).append(lo)
    plan = []
    for length, starts in by_length.items():
        contiguous = all(b - a == length for a, b in zip(starts[:-1], starts[1:]))
        if contiguous:
            plan.append(_Group(length, len(starts), starts[0], None))
        else:
            rows = torch.cat([torch.arange(s, s + length) for s in starts])
            plan.append(_Group(length, len(starts), None, rows.to(cu_seqlens.device, non_blocking=True)))
    return plan


def segment_plan(cu_seqlens: torch.Tensor) -> list[_Group]:
    """The plan for ``cu_seqlens``, cached on the tensor object (the vision tower passes the same
    tensor to every layer of a forward, so it is built once per forward)."""
    plan = getattr(cu_seqlens, _PLAN_ATTR, None)
    if plan is None:
        plan = _build_plan(cu_seqlens)
        try:
            setattr(cu_seqlens, _PLAN_ATTR, plan)
        except (AttributeError, RuntimeError):  # pragma: no cover - tensors normally take attributes
            pass
    return plan


# ----------------------------------------------------------------------------------------------
# the batched vision attention


def _hf_vision_module():
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf

    return hf


def batched_vision_attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_seqlen: int | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """``Qwen2_5_VLVisionAttention.forward`` with one attention call per distinct segment length."""
    hf = _hf_vision_module()
    if hf.is_flash_attention_requested(self.config):  # flash-attn is already variable-length: keep it
        return getattr(self, _ORIG_FORWARD)(hidden_states, cu_seqlens, position_embeddings, max_seqlen, **kwargs)

    seq_length = hidden_states.shape[0]
    query_states, key_states, value_states = (
        self.qkv(hidden_states).reshape(seq_length, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    )
    cos, sin = position_embeddings
    query_states, key_states = hf.apply_rotary_pos_emb_vision(query_states, key_states, cos, sin)
    heads, head_dim = query_states.shape[1], query_states.shape[2]

    attention_interface = hf.ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, hf.eager_attention_forward
    )
    dropout = 0.0 if not self.training else self.attention_dropout

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, length: int) -> torch.Tensor:
        # [count * length, H, D] -> [count, H, length, D]; returns [count * length, H * D]
        q, k, v = (t.reshape(count, length, heads, head_dim).transpose(1, 2) for t in (q, k, v))
        out = attention_interface(
            self, q, k, v, attention_mask=None, scaling=self.scaling, dropout=dropout, is_causal=False, **kwargs
        )[0]
        return out.reshape(count * length, heads * head_dim)

    plan = segment_plan(cu_seqlens)
    if len(plan) == 1 and plan[0].start == 0 and plan[0].count * plan[0].length == seq_length:
        g = plan[0]
        attn_output = attend(query_states, key_states, value_states, g.count, g.length)
    else:
        attn_output = query_states.new_empty(seq_length, heads * head_dim)
        for g in plan:
            if g.index is None:
                rows = slice(g.start, g.start + g.count * g.length)
                attn_output[rows] = attend(query_states[rows], key_states[rows], value_states[rows], g.count, g.length)
            else:
                picked = [t.index_select(0, g.index) for t in (query_states, key_states, value_states)]
                attn_output.index_copy_(0, g.index, attend(*picked, g.count, g.length))

    return self.proj(attn_output.contiguous())


# ----------------------------------------------------------------------------------------------
# enabling / disabling


def _vision_classes():
    hf = _hf_vision_module()
    return hf.Qwen2_5_VLVisionAttention, hf.Qwen2_5_VisionTransformerPretrainedModel


def _frozen_no_grad_forward(self: nn.Module, *args: Any, **kwargs: Any):
    original = getattr(self, _ORIG_FORWARD)
    if torch.is_grad_enabled() and not any(p.requires_grad for p in self.parameters()):
        with torch.no_grad():
            return original(*args, **kwargs)
    return original(*args, **kwargs)


@dataclass
class FastPathHandle:
    """What :func:`enable_fast_path` changed; ``disable()`` restores the stock forwards."""

    attention_modules: list[nn.Module] = field(default_factory=list)
    vision_towers: list[nn.Module] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return bool(self.attention_modules or self.vision_towers)

    def disable(self) -> None:
        for module in self.attention_modules + self.vision_towers:
            if _ORIG_FORWARD in module.__dict__:
                del module.__dict__["forward"]
                del module.__dict__[_ORIG_FORWARD]
        self.attention_modules.clear()
        self.vision_towers.clear()


def enable_fast_path(model: nn.Module, batched_windows: bool = True, frozen_vision_no_grad: bool = True) -> FastPathHandle:
    """Switch every Qwen2.5-VL vision tower inside ``model`` to the fast path (idempotent).

    ``batched_windows``: one attention call per distinct window length instead of one per window.
    ``frozen_vision_no_grad``: run the vision tower under ``torch.no_grad()`` while none of its
    parameters requires a gradient (checked at every call, so unfreezing it later is safe).
    Returns a :class:`FastPathHandle`; ``handle.disable()`` restores the stock forwards.
    Works on a :class:`~lychee_pipeline.reranker.model.LycheeReranker`, a peft model or a bare
    ``Qwen2_5_VLForConditionalGeneration``; modules of other architectures are left alone.
    """
    attention_cls, tower_cls = _vision_classes()
    handle = FastPathHandle()
    for module in model.modules():
        if _ORIG_FORWARD in module.__dict__:
            continue  # already patched
        if batched_windows and isinstance(module, attention_cls):
            module.__dict__[_ORIG_FORWARD] = module.forward
            module.forward = types.MethodType(batched_vision_attention_forward, module)
            handle.attention_modules.append(module)
        elif frozen_vision_no_grad and isinstance(module, tower_cls):
            module.__dict__[_ORIG_FORWARD] = module.forward
            module.forward = types.MethodType(_frozen_no_grad_forward, module)
            handle.vision_towers.append(module)
    return handle


def disable_fast_path(model: nn.Module) -> None:
    """Undo :func:`enable_fast_path` on every module of ``model``."""
    handle = FastPathHandle()
    for module in model.modules():
        if _ORIG_FORWARD in module.__dict__:
            handle.attention_modules.append(module)
    handle.disable()


# ----------------------------------------------------------------------------------------------
# selective activation checkpointing


def _hf_model(model: nn.Module) -> nn.Module:
    """The outermost transformers ``PreTrainedModel`` inside ``model`` (through LycheeReranker / peft)."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module
    raise TypeError(f"no transformers PreTrainedModel inside {type(model).__name__}")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The language model's decoder layers, in order."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf

    return [m for m in model.modules() if isinstance(m, hf.Qwen2_5_VLDecoderLayer)]


def apply_selective_checkpointing(model: nn.Module, layers: int | float | None = None) -> int:
    """Activation checkpointing (non-reentrant) on the first ``layers`` decoder layers only.

    ``layers``: a count (int), a fraction in [0, 1] of the decoder layers (float), or ``None`` for all of them;
    ``0`` turns checkpointing off. The vision tower's blocks are never checkpointed when the tower is
    frozen (it runs without autograd on the fast path). Uses the stock transformers switch first, so
    every layer gets the same checkpoint function as with plain checkpointing, then clears the flag
    of the layers that keep their activations. Returns the number of checkpointed decoder layers.
    """
    hf_model = _hf_model(model)
    layer_list = decoder_layers(hf_model)
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
    _, tower_cls = _vision_classes()
    for tower in (m for m in hf_model.modules() if isinstance(m, tower_cls)):
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
