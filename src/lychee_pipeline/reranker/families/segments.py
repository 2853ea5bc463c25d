"""Segment plans of a packed vision sequence: which rows form same-length groups, known on the host.

A vision tower that takes every image's patches as one flattened sequence bounds its attention segments
(images, or windows of them) by ``cu_seqlens``. Grouping the segments by length lets the vision attention
(:func:`batched_vision_attention_forward`, bound by both families' fast paths) run one call per distinct length;
the plan is built once per ``cu_seqlens`` tensor and travels on it as an attribute, so no layer reads the bounds
back from the device. Family-neutral: packing (``reranker/packing.py``) moves the plans' row indices with a batch.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from .base import ORIG_FORWARD

PLAN_ATTR = "_lychee_segment_plan"


@dataclass
class SegmentGroup:
    length: int  # tokens per segment
    count: int  # segments in the group
    start: int | None  # first row, when the group's segments are one contiguous run
    index: torch.Tensor | None  # row indices [count * length] otherwise

    def rows_on(self, device: torch.device) -> torch.Tensor:
        """The row indices on ``device`` (a prepared batch's plan has them there already, see
        :func:`map_segment_rows`; otherwise they are copied here)."""
        return self.index if self.index.device == device else self.index.to(device, non_blocking=True)


def build_plan(cu_seqlens: torch.Tensor) -> list[SegmentGroup]:
    """The segments bounded by ``cu_seqlens`` grouped by length, in order of first appearance (reads the bounds)."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    by_length: OrderedDict[int, list[int]] = OrderedDict()
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi > lo:
            by_length.setdefault(hi - lo, []).append(lo)
    plan = []
    for length, starts in by_length.items():
        contiguous = all(b - a == length for a, b in zip(starts[:-1], starts[1:]))
        if contiguous:
            plan.append(SegmentGroup(length, len(starts), starts[0], None))
        else:
            rows = torch.cat([torch.arange(s, s + length) for s in starts])
            plan.append(SegmentGroup(length, len(starts), None, rows.to(cu_seqlens.device, non_blocking=True)))
    return plan


def segment_plan(cu_seqlens: torch.Tensor) -> list[SegmentGroup]:
    """The plan for ``cu_seqlens``, cached on the tensor object (the vision tower passes the same
    tensor to every layer of a forward, so it is built once per forward)."""
    plan = getattr(cu_seqlens, PLAN_ATTR, None)
    if plan is None:
        plan = build_plan(cu_seqlens)
        try:
            setattr(cu_seqlens, PLAN_ATTR, plan)
        except (AttributeError, RuntimeError):  # pragma: no cover - tensors normally take attributes
            pass
    return plan


def map_segment_rows(inputs: dict[str, Any], fn) -> dict[str, Any]:
    """``inputs`` with every segment-bound tensor's plan given row indices ``fn(index)`` (page-locked, moved to a
    device), on a new handle of the same bounds: the plan built on the host stays as it was."""
    mapped = dict(inputs)
    for key, value in inputs.items():
        plan = getattr(value, PLAN_ATTR, None) if isinstance(value, torch.Tensor) else None
        if plan is not None:
            handle = value.view_as(value)
            setattr(handle, PLAN_ATTR, [g if g.index is None else replace(g, index=fn(g.index)) for g in plan])
            mapped[key] = handle
    return mapped


def batched_vision_attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_seqlen: int | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """A vision attention module's forward (``Qwen2_5_VLVisionAttention``: windows and whole images as segments;
    ``Qwen3VLVisionAttention``, the same forward: whole images) with one attention call per distinct segment
    length. Bound by each family's fast path; with flash-attn, which is variable-length already, the module's own
    forward runs."""
    hf = sys.modules[type(self).__module__]  # the module's own transformers modelling file (either family)
    if hf.is_flash_attention_requested(self.config):  # flash-attn is already variable-length: keep it
        cu_seqlens = cu_seqlens.to(hidden_states.device, non_blocking=True)  # prepared on the host
        return getattr(self, ORIG_FORWARD)(hidden_states, cu_seqlens, position_embeddings, max_seqlen, **kwargs)

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
                rows = g.rows_on(hidden_states.device)
                picked = [t.index_select(0, rows) for t in (query_states, key_states, value_states)]
                attn_output.index_copy_(0, rows, attend(*picked, g.count, g.length))

    return self.proj(attn_output.contiguous())
