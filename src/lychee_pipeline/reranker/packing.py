"""Packing a group's pairs into one sequence: no padding tokens through the language model.

The collator pads every pair of a micro-batch to its longest row (left padding): at the Lychee shape (8
pairs, ~853 tokens each) 12% of the tokens the decoder processes are padding. :func:`packed_last_hidden`
instead concatenates the real tokens of all rows into one sequence of batch 1 and runs the decoder on that,
with three things kept equal to the padded path:

* **mRoPE positions.** Qwen2.5-VL's 3-D positions (temporal, height, width) are computed for the padded batch
  by the model's own ``get_rope_index`` (as the unpacked forward does), then only the real tokens are kept
  and concatenated: every pair's positions start again at 0 and its image tokens get the same 3-D grid as
  when padded.
* **Attention stays within a pair** (block-diagonal, causal inside each block). The language model's
  attention is switched to :data:`PACKED_ATTENTION`, an attention function registered with transformers that
  runs one causal SDPA call per pair (``is_causal=True``, no mask tensor) when the forward carries a
  :class:`PackPlan`, and is plain SDPA otherwise. Without a mask, SDPA on a CUDA GPU takes its
  flash-attention kernel, and each call only computes its own pair's triangle — no dense T×T mask.
  (transformers' own packed-sequence detection would build a dense 4-D boolean mask for SDPA, which forces
  the slower memory-efficient kernel over the whole T×T square, ~6× the attention work of 8 pairs; its
  flex-attention path compiles ``flex_attention`` with ``dynamic=False``, so every new packed length would
  recompile; flash-attn's varlen kernel is not installed on the machines this project runs on.)
* **The score** is read at each pair's last real token (``cumsum(lengths) - 1`` in the packed sequence).

The vision tower is unchanged: it already takes every image's patches as one flattened sequence.
Only torch and transformers are needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

PACKED_ATTENTION = "lychee_packed_sdpa"
PLAN_KWARG = "lychee_pack_cu_seqlens"  # the keyword the plan travels under, from the model's forward to attention
_REGISTERED = False


_BOUNDS_ATTR = "_lychee_pack_bounds"


@dataclass(frozen=True)
class PackPlan:
    """Where each pair lies in the packed sequence: pair ``i`` is ``[starts[i], ends[i])``."""

    starts: tuple[int, ...]
    ends: tuple[int, ...]

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(e - s for s, e in zip(self.starts, self.ends))

    def as_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``cu_seqlens`` ([pairs + 1], int32) carrying the plan itself as an attribute.

        The plan travels to the attention function as this tensor rather than as a Python object so that a
        ``torch.compile``-d decoder layer sees an ordinary tensor input (no guard on the pair lengths, no
        recompilation per group); the attention reads the bounds from the attribute, without a device sync.
        """
        cu = torch.tensor((0,) + self.ends, dtype=torch.int32, device=device)
        setattr(cu, _BOUNDS_ATTR, self)
        return cu


def plan_of(cu_seqlens: torch.Tensor) -> PackPlan:
    plan = getattr(cu_seqlens, _BOUNDS_ATTR, None)
    if plan is None:  # a tensor built elsewhere: read it (one host sync)
        bounds = [int(b) for b in cu_seqlens.tolist()]
        plan = PackPlan(tuple(bounds[:-1]), tuple(bounds[1:]))
    return plan


def _sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


@torch.compiler.disable  # a graph break around attention: the loop over pairs is not traced into a compiled layer
def packed_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA per pair when the forward carries a :class:`PackPlan`, plain SDPA otherwise.

    The plan comes as ``cu_seqlens`` (see :meth:`PackPlan.as_tensor`). ``query`` is [1, heads, T, head_dim]
    for a packed sequence; the output is [1, T, heads, head_dim], as transformers' SDPA function returns it.
    """
    cu_seqlens: torch.Tensor | None = kwargs.pop(PLAN_KWARG, None)
    sdpa = _sdpa()
    if cu_seqlens is None:
        return sdpa(module, query, key, value, attention_mask, **kwargs)
    plan = plan_of(cu_seqlens)
    if attention_mask is not None:
        raise ValueError("a packed forward must not carry an attention mask (pairs are separated by the plan)")
    if len(plan.starts) == 1:
        return sdpa(module, query, key, value, None, is_causal=True, **kwargs)
    outputs = []
    for start, end in zip(plan.starts, plan.ends):
        out, _ = sdpa(module, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], None,
                      is_causal=True, **kwargs)
        outputs.append(out)
    return torch.cat(outputs, dim=1), None


def register_packed_attention() -> None:
    """Make :data:`PACKED_ATTENTION` known to transformers (idempotent). For mask building it behaves as SDPA,
    so a padded batch sent to a model switched to it still gets its padding mask."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)
    _REGISTERED = True


def _text_configs(model: nn.Module) -> list[Any]:
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf

    configs = []
    for module in model.modules():
        if isinstance(module, hf.Qwen2_5_VLTextModel) and all(module.config is not c for c in configs):
            configs.append(module.config)
    return configs


def enable_packed_attention(model: nn.Module) -> int:
    """Switch the language model(s) inside ``model`` to :data:`PACKED_ATTENTION` (the vision tower keeps its
    own). Returns how many text configs were switched. Needs SDPA or the packed function already."""
    register_packed_attention()
    configs = _text_configs(model)
    for config in configs:
        current = config._attn_implementation
        if current not in ("sdpa", PACKED_ATTENTION):
            raise ValueError(f"packing pairs needs attn_implementation 'sdpa' for the language model, got {current!r} "
                             "(set model.attn_implementation: sdpa, or model.pack_pairs: false)")
        config._attn_implementation = PACKED_ATTENTION
    return len(configs)


def _mm_token_types(vl_model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Text 0, image 1, video 2 — what the processor's ``mm_token_type_ids`` holds, from the token ids."""
    config = vl_model.config
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == config.image_token_id] = 1
    types[input_ids == config.video_token_id] = 2
    return types


def pack_inputs(vl_model: nn.Module, batch: dict[str, Any]) -> tuple[dict[str, Any], PackPlan, torch.Tensor]:
    """Model inputs for one packed sequence from a padded batch (either padding side).

    ``vl_model`` is the ``Qwen2_5_VLModel`` (for ``get_rope_index``). Returns the inputs (batch 1, position
    ids [4, 1, T]: transformers' packed layout, row 0 the text positions restarting per pair, rows 1-3 the
    mRoPE positions), the :class:`PackPlan`, and the index of every pair's last token in the packed sequence.
    """
    input_ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    keep = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
    lengths = keep.sum(dim=1)
    lengths_host = [int(n) for n in lengths.tolist()]  # the one host sync of the packing
    if min(lengths_host) <= 0:
        raise ValueError("every pair needs at least one real token to be packed")

    token_types = batch.get("mm_token_type_ids")
    if token_types is None:
        token_types = _mm_token_types(vl_model, input_ids)
    image_grid = batch.get("image_grid_thw")
    video_grid = batch.get("video_grid_thw")
    text_positions = (keep.long().cumsum(dim=1) - 1)[keep]  # 0 .. len-1 per pair, whatever the padding side
    if image_grid is not None or video_grid is not None:
        rope_kwargs = {"image_grid_thw": image_grid, "video_grid_thw": video_grid, "attention_mask": keep.long()}
        if batch.get("second_per_grid_ts") is not None:
            rope_kwargs["second_per_grid_ts"] = batch["second_per_grid_ts"]
        positions, _ = vl_model.get_rope_index(input_ids, mm_token_type_ids=token_types, **rope_kwargs)
        mrope = positions[:, keep]  # [3, T]: the padded path's positions of the real tokens, rows in order
    else:
        mrope = text_positions.unsqueeze(0).expand(3, -1)
    position_ids = torch.cat([text_positions.unsqueeze(0), mrope.to(text_positions.dtype)], dim=0).unsqueeze(1)

    ends = torch.tensor(lengths_host).cumsum(0)
    plan = PackPlan(tuple((ends - torch.tensor(lengths_host)).tolist()), tuple(ends.tolist()))
    inputs = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    inputs["input_ids"] = input_ids[keep].unsqueeze(0)
    inputs["mm_token_type_ids"] = token_types[keep].unsqueeze(0)
    inputs["position_ids"] = position_ids
    last_index = (ends - 1).to(input_ids.device)
    return inputs, plan, last_index


def packed_last_hidden(vl_model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """[N, hidden]: the last hidden state at every pair's last token, from one packed forward of
    ``vl_model`` (a ``Qwen2_5_VLModel`` whose language model uses :data:`PACKED_ATTENTION`)."""
    if any(c._attn_implementation != PACKED_ATTENTION for c in _text_configs(vl_model)):
        raise RuntimeError("the language model is not switched to packed attention: call enable_packed_attention")
    inputs, plan, last_index = pack_inputs(vl_model, batch)
    # the text row of the positions is dropped on purpose: with row 0 present, transformers would also build a
    # dense packed T×T mask; the plan below separates the pairs instead
    inputs["position_ids"] = inputs["position_ids"][1:]
    outputs = vl_model(**inputs, use_cache=False, return_dict=True, **{PLAN_KWARG: plan.as_tensor()})
    return outputs.last_hidden_state[0].index_select(0, last_index)
