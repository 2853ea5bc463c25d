"""Segment plans of a packed vision sequence: which rows form same-length groups, known on the host.

A vision tower that takes every image's patches as one flattened sequence bounds its attention segments
(images, or windows of them) by ``cu_seqlens``. Grouping the segments by length lets a family's batched vision
attention run one call per distinct length (``qwen2_5_vl/fast_vision.py``); the plan is built once per
``cu_seqlens`` tensor and travels on it as an attribute, so no layer reads the bounds back from the device.
Family-neutral: packing (``reranker/packing.py``) moves the plans' row indices with a batch.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import torch

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


