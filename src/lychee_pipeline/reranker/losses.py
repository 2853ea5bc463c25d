"""Reranker losses, computed in fp32 whatever the model's dtype, and the registry training picks them from.

``logits`` are the (yes, no) logits of :class:`~lychee_pipeline.reranker.model.LycheeReranker`,
Tensor[N, 2], with documents grouped as the group collator lays them out: ``N = B * G``, the
positive first in each group of ``G``.

Adding a loss is one function under a name (``training.loss`` then accepts the name)::

    @register_loss("my_loss")
    def my_loss(logits, labels, group_weight, options: LossOptions) -> torch.Tensor: ...

A loss defined outside this module is registered by importing its module: name it in
``training.loss_modules`` (import paths), and the planner and every stage process import it before the loss
name is checked (``import_loss_modules``).

``labels`` [N] are 1 for the positive and 0 for negatives, ``group_weight`` [B] is 0 for a padding
slot of an epoch and 1 otherwise (a group of weight 0 must add nothing to the loss or its gradient),
and the result is the mean over the micro-batch's B groups (the trainer scales it to the global batch).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def _weighted_mean(losses: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """Mean of ``weights * losses`` over all items (a zero weight, e.g. a padding slot, contributes nothing)."""
    if weights is None:
        return losses.mean()
    weights = weights.to(device=losses.device, dtype=torch.float32).reshape(-1)
    if weights.numel() != losses.numel():
        raise ValueError(f"{weights.numel()} weights for {losses.numel()} losses")
    return (weights * losses).mean()


def pointwise_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """SFT loss (the default): cross-entropy of the yes/no answer for every document, averaged.

    ``labels`` [N]: 1 for relevant (target ``yes``), 0 for not (target ``no``); values in between act
    as soft targets. Equals ``-mean(y * log p_yes + (1 - y) * log p_no)`` with
    ``p = softmax(logits)``. ``weights`` [N] (optional) weigh each document's term; the mean stays over N.
    """
    if logits.dim() != 2 or logits.size(-1) != 2:
        raise ValueError(f"logits must be [N, 2] (yes, no), got {tuple(logits.shape)}")
    labels = labels.to(device=logits.device, dtype=torch.float32).reshape(-1)
    if labels.numel() != logits.size(0):
        raise ValueError(f"{labels.numel()} labels for {logits.size(0)} documents")
    logp = F.log_softmax(logits.float(), dim=-1)
    return _weighted_mean(-(labels * logp[:, 0] + (1.0 - labels) * logp[:, 1]), weights)


def group_scores(logits: torch.Tensor, score: str = "yes_minus_no") -> torch.Tensor:
    """Per-document score used for ranking: ``yes - no`` (monotone in p(yes)) or the raw ``yes`` logit."""
    logits = logits.float()
    if score == "yes_minus_no":
        return logits[:, 0] - logits[:, 1]
    if score == "yes":
        return logits[:, 0]
    raise ValueError(f"score must be 'yes_minus_no' or 'yes', got {score!r}")


def listwise_loss(
    logits: torch.Tensor,
    group_size: int,
    temperature: float = 1.0,
    score: str = "yes_minus_no",
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Contrastive (InfoNCE) loss over each group of ``group_size`` documents, positive first.

    The score of a document is ``z_yes - z_no`` by default (the logit of p(yes), so the loss ranks
    exactly what inference returns); ``score="yes"`` uses the raw yes logit as in the paper's
    contrastive baseline. Loss per group: ``-log softmax(scores / temperature)[0]``, averaged over groups
    (``weights`` [groups], optional, weigh each group's term; the mean stays over all groups).
    """
    if logits.dim() != 2 or logits.size(-1) != 2:
        raise ValueError(f"logits must be [N, 2] (yes, no), got {tuple(logits.shape)}")
    if group_size < 2 or logits.size(0) % group_size:
        raise ValueError(f"{logits.size(0)} documents do not split into groups of {group_size}")
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    scores = group_scores(logits, score).view(-1, group_size) / float(temperature)
    target = torch.zeros(scores.size(0), dtype=torch.long, device=scores.device)
    return _weighted_mean(F.cross_entropy(scores, target, reduction="none"), weights)


# ----------------------------------------------------------------------------------------------
# the registry


@dataclass(frozen=True)
class LossOptions:
    """What a registered loss may read besides the batch: the group layout and the loss settings of training."""

    group_size: int  # documents per group, the positive first
    temperature: float = 1.0  # listwise: scores are divided by it


LossFunction = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, LossOptions], torch.Tensor]
LOSSES: dict[str, LossFunction] = {}


def register_loss(name: str) -> Callable[[LossFunction], LossFunction]:
    """Decorator: make ``fn(logits, labels, group_weight, options)`` the loss called ``name``."""

    def register(fn: LossFunction) -> LossFunction:
        if name in LOSSES and LOSSES[name] is not fn:
            raise ValueError(f"a loss named {name!r} is already registered ({LOSSES[name].__qualname__})")
        LOSSES[name] = fn
        return fn

    return register


def get_loss(name: str) -> LossFunction:
    """The loss registered as ``name``; an unknown name is a one-line error naming the known ones."""
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; known losses: {', '.join(sorted(LOSSES))}") from None


@register_loss("pointwise")
def pointwise(logits: torch.Tensor, labels: torch.Tensor, group_weight: torch.Tensor,
              options: LossOptions) -> torch.Tensor:
    """:func:`pointwise_loss`, every document weighed by its group's weight."""
    return pointwise_loss(logits, labels, group_weight.repeat_interleave(options.group_size))


@register_loss("listwise")
def listwise(logits: torch.Tensor, labels: torch.Tensor, group_weight: torch.Tensor,
             options: LossOptions) -> torch.Tensor:
    """:func:`listwise_loss` at ``options.temperature`` (the positive is first in every group, labels unused)."""
    return listwise_loss(logits, options.group_size, options.temperature, weights=group_weight)


def import_loss_modules(modules: Iterable[str]) -> None:
    """Import each module by its import path, so its ``@register_loss`` functions are registered here.

    A module that does not import is a one-line error naming it and why."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - any failure of a user's module is reported, in one line
            reason = (str(exc).splitlines() or [""])[0]
            raise ValueError(f"loss module {module!r} does not import: {type(exc).__name__}: {reason}") from None
