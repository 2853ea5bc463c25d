"""One training step: forward, loss and backward per micro-batch; at the end of an accumulation, gradient
clipping and the optimizer step, which a non-finite loss or gradient never reaches.

The stage's loop (``training/train.py``) and the benchmarks (``benchmarks/train_stage.py``,
``benchmarks/train_step.py``) run this same step, so a benchmark's figure is the stage's step. Kedro- and
MLflow-free (the GPU benchmark machine has neither): torch and the reranker's loss contract only; the
accelerator is Accelerate's when the stage runs, :class:`OneProcess` in a benchmark's single process.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from lychee_pipeline.reranker.losses import LossFunction, LossOptions


class MicroBatch(NamedTuple):
    """A collated micro-batch split into what the model reads and what the loss and the step log read."""

    inputs: dict  # the model's keyword arguments
    labels: torch.Tensor
    group_weight: torch.Tensor  # [groups]: 0 for an epoch's padding slots, 1 otherwise
    loss_scale: float  # the micro-batch's share of the mean over the global batch's real groups
    tokens: int  # real tokens, counted by the collator on the host (no device read-back)
    truncation: dict[str, int]  # the collator's truncation counts for this micro-batch
    record_index: torch.Tensor | None  # tests only (LYCHEE_TRACE_RECORDS=1): -1 for padding slots

    @classmethod
    def of(cls, batch: dict) -> MicroBatch:
        """From a batch of ``training.train.StageCollate`` (the stage's loader)."""
        inputs = dict(batch)
        labels = inputs.pop("labels")
        inputs.pop("group_size")
        return cls(inputs, labels, inputs.pop("group_weight"), inputs.pop("loss_scale"), int(inputs.pop("tokens")),
                   inputs.pop("truncation"), inputs.pop("record_index", None))

    @classmethod
    def unweighted(cls, batch: dict) -> MicroBatch:
        """From a plain ``GroupCollator`` batch (the benchmarks): every group real, the loss at scale 1."""
        inputs = dict(batch)
        labels = inputs.pop("labels")
        group_size = inputs.pop("group_size")
        weights = torch.ones(labels.numel() // group_size, device=labels.device)  # no copy inside a timed step
        return cls(inputs, labels, weights, 1.0, int(inputs["attention_mask"].sum()), {}, None)


class OneProcess:
    """The part of Accelerate's ``Accelerator`` the step uses, for one process without Accelerate: no
    accumulation, plain backward and clipping, a reduction over one process."""

    sync_gradients = True

    def __init__(self, device: torch.device):
        self.device = device

    def accumulate(self, model: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip_grad_norm_(self, parameters: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    def reduce(self, tensor: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        return tensor


class TrainStep:
    """``step(micro_batch)``: the micro-batch's forward and backward; returns None inside an accumulation, and
    at its end (after the optimizer step) the step's figures on the device: [mean loss, gradient norm].

    ``skip_on_device``: a fused torch optimizer is told ``found_inf`` (as GradScaler does) and skips a
    non-finite step on the device, so nothing is read back before stepping (the DDP stage). Otherwise (the
    DeepSpeed / FSDP templates wrap the optimizer) the figures are read back and the host decides, every step.
    The scheduler follows the run's step, skipped or not.
    """

    def __init__(self, accelerator: Any, model: Callable[..., torch.Tensor], optimizer: torch.optim.Optimizer,
                 scheduler: Any, trainable: list[torch.nn.Parameter], compute_loss: LossFunction,
                 loss_options: LossOptions, max_grad_norm: float, skip_on_device: bool):
        self.accelerator, self.model, self.optimizer, self.scheduler = accelerator, model, optimizer, scheduler
        self.trainable, self.max_grad_norm, self.skip_on_device = trainable, max_grad_norm, skip_on_device
        self.compute_loss, self.loss_options = compute_loss, loss_options
        self.inner_optimizer = getattr(optimizer, "optimizer", optimizer)  # under Accelerate's wrapper

    def __call__(self, batch: MicroBatch, nan_fault: bool = False) -> torch.Tensor | None:
        accelerator = self.accelerator
        with accelerator.accumulate(self.model):
            logits = self.model(**batch.inputs)
            loss = self.compute_loss(logits, batch.labels, batch.group_weight, self.loss_options)
            loss = loss * batch.loss_scale  # the mean over the global batch's real groups (padding weighs 0)
            if nan_fault:  # training.faults.injected_nan: the reliability tests' non-finite step
                loss = loss * float("nan")
            accelerator.backward(loss)
            if not accelerator.sync_gradients:
                return None
            return self.optimizer_step(loss)

    def optimizer_step(self, loss: torch.Tensor) -> torch.Tensor:
        """Clip, reduce the loss over the processes, step unless a figure is non-finite, schedule, zero."""
        accelerator = self.accelerator
        grad_norm = torch.as_tensor(accelerator.clip_grad_norm_(self.trainable, self.max_grad_norm),
                                    device=accelerator.device).float()
        mean_loss = accelerator.reduce(loss.detach().float(), reduction="mean")
        figures = torch.stack([mean_loss, grad_norm.reshape(())])
        if self.skip_on_device:  # a non-finite loss or gradient never reaches the weights, decided on the device
            self.inner_optimizer.found_inf = (~torch.isfinite(figures).all()).float()
            self.optimizer.step()
        elif all(math.isfinite(v) for v in figures.tolist()):
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad()
        return figures
