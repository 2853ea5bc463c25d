"""LoRA's branch ``base(x) + B(A(dropout(x))) · scaling`` as one autograd function, for training.

Why: peft's ``lora.Linear`` runs the branch as separate modules, and on the project's bf16 step that costs both
memory and time out of proportion to the rank-16 adapters (the H100 profile of 2026-12-05, docs/benchmarks.md):

* peft casts the layer input to the adapter's dtype (fp32 adapters on a bf16 model) before its dropout, so each
  adapted projection writes an fp32 copy of the input, a dropped copy and its mask, and autocast casts that back
  to bf16 for ``lora_A``: 5.8% of the step in dtype copies, 4.2% in dropout kernels;
* autograd keeps, for each adapted projection, the dropout's mask (1 byte a value) and ``lora_A``'s dropped bf16
  input (2 bytes): with the default q/k/v/o targets 12 bytes per token and hidden unit in every decoder layer
  that keeps its activations, about a third of what such a layer keeps (training/memory.py);
* the scale and the add to the base output are two more full-width kernels per projection.

Here the function keeps the layer input itself (q, k and v share it: one tensor) and the random generator's
state, and draws the same dropout mask again in the backward; the scale and the add run inside one ``addmm``.
Without dropout nothing is drawn. The matmuls run in the dtype peft's would (autocast's where it is on, else the
adapter's), so on the CPU's fp32 model the results are peft's to rounding; the masks are the generator's own
draws, so a run is as reproducible as with peft (``torch.utils.checkpoint`` restores the generator before its
recomputation, and the backward replays the state saved by the forward it belongs to).

Only the plain case is taken over: one active vanilla LoRA adapter on a ``peft`` ``lora.Linear``, in training with
gradients on. Anything else (eval, merged or disabled adapters, several adapters, DoRA and other variants, QLoRA's
4-bit layers, extra forward arguments) runs peft's own forward.

``model.lora.fused``: ``auto`` (the default) on CUDA devices, where drawing a mask again is one cheap kernel and
memory is what limits a step; a CPU's generator draws each value in sequence, so there the second draw would cost
more than it saves (tiny model, r=16: 1.5-2x the branch's time), and ``auto`` keeps peft's forward. ``true``: on
any device; ``false``: peft's forward everywhere.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn


def wants_fused(setting: bool | str, device: torch.device | None) -> bool:
    """``model.lora.fused`` resolved for ``device`` (see the module's docstring)."""
    if setting == "auto":
        return device is not None and torch.device(device).type == "cuda"
    return bool(setting)


def _generator_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


@contextlib.contextmanager
def _generator_replaying(device: torch.device, state: torch.Tensor):
    """The device's default generator at ``state`` inside, as it was outside (the mask is drawn a second time
    without moving the stream the rest of the run draws from)."""
    on_cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if on_cuda else []):  # the CPU's generator is always forked
        if on_cuda:
            torch.cuda.set_rng_state(state, device)
        else:
            torch.set_rng_state(state)
        yield


def _dropped(x2: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    if p == 0.0:
        return x2, None
    return torch.native_dropout(x2, p, True)


class LoraBranch(torch.autograd.Function):
    """``base_out + scaling · dropout(x) Aᵀ Bᵀ``, keeping ``x``, the small ``dropout(x) Aᵀ`` and the generator's
    state for the backward (not the mask nor the dropped input)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, base_out: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor,
                p: float, scaling: float, compute_dtype: torch.dtype) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):  # the dtypes below are chosen, not autocast's
            state = _generator_state(x.device) if p > 0.0 else None
            x2 = x.reshape(-1, x.shape[-1]).to(compute_dtype)
            dropped, _ = _dropped(x2, p)
            hidden = dropped @ weight_a.to(compute_dtype).t()
            base2 = base_out.reshape(-1, base_out.shape[-1])
            out = torch.addmm(base2.to(compute_dtype), hidden, weight_b.to(compute_dtype).t(), alpha=scaling)
        ctx.save_for_backward(x, hidden, weight_a, weight_b)
        ctx.state, ctx.p, ctx.scaling, ctx.compute_dtype = state, p, scaling, compute_dtype
        return out.to(base_out.dtype).reshape(base_out.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        x, hidden, weight_a, weight_b = ctx.saved_tensors
        dtype, scaling, p = ctx.compute_dtype, ctx.scaling, ctx.p
        grad2 = grad.reshape(-1, grad.shape[-1]).to(dtype)
        x2 = x.reshape(-1, x.shape[-1]).to(dtype)
        with _generator_replaying(x.device, ctx.state) if p > 0.0 else contextlib.nullcontext():
            dropped, mask = _dropped(x2, p)
        grad_hidden = (grad2 @ weight_b.to(dtype)).mul_(scaling)
        grad_b = (grad2.t() @ hidden).mul_(scaling)
        grad_a = grad_hidden.t() @ dropped
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_hidden @ weight_a.to(dtype)
            if mask is not None:
                grad_x = torch.ops.aten.native_dropout_backward(grad_x, mask, 1.0 / (1.0 - p))
            grad_x = grad_x.to(x.dtype).reshape(x.shape)
        return grad_x, grad, grad_a.to(weight_a.dtype), grad_b.to(weight_b.dtype), None, None, None


def _single_vanilla_adapter(layer: nn.Module) -> str | None:
    """The one active adapter ``layer`` runs as plain LoRA, or None where peft's forward must run."""
    if layer.disable_adapters or layer.merged:
        return None
    active = [name for name in layer.active_adapters if name in layer.lora_A]
    if len(active) != 1 or active[0] in getattr(layer, "lora_variant", {}):
        return None
    if not isinstance(layer.lora_dropout[active[0]], (nn.Dropout, nn.Identity)):
        return None
    return active[0]


def _fused_forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    adapter = None
    if self.training and torch.is_grad_enabled() and not args and not kwargs:
        adapter = _single_vanilla_adapter(self)
    if adapter is None:
        return type(self).forward(self, x, *args, **kwargs)
    weight_a, weight_b = self.lora_A[adapter].weight, self.lora_B[adapter].weight
    dropout = self.lora_dropout[adapter]
    device_type = x.device.type
    # peft casts x to the adapter's dtype; autocast, where it is on, then runs the matmuls in its own dtype
    compute_dtype = (torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type)
                     else weight_a.dtype)
    return LoraBranch.apply(x, self.base_layer(x), weight_a, weight_b,
                            float(dropout.p) if isinstance(dropout, nn.Dropout) else 0.0,
                            float(self.scaling[adapter]), compute_dtype)


def fuse_lora_branches(model: nn.Module) -> int:
    """Give every peft ``lora.Linear`` of ``model`` (exactly that class: QLoRA's 4-bit layers keep peft's forward)
    the one-function branch above; returns how many layers have it. Idempotent."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    count = 0
    for module in model.modules():
        if type(module) is LoraLinear:
            module.__dict__["forward"] = _fused_forward.__get__(module, type(module))
            count += 1
    return count


def fused_branches(model: nn.Module) -> int:
    """How many layers of ``model`` run the one-function branch (the memory model's regime depends on it)."""
    return sum(getattr(m.__dict__.get("forward"), "__func__", None) is _fused_forward for m in model.modules())


def unfuse_lora_branches(model: nn.Module) -> int:
    """peft's own forward on every layer :func:`fuse_lora_branches` changed (benchmarks compare the two)."""
    count = 0
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if getattr(forward, "__func__", None) is _fused_forward:
            del module.__dict__["forward"]
            count += 1
    return count
