"""Fused kernels and compiled decoder layers for the reranker (``model.kernels``, ``model.compile_layers``).

The profile of the project's training step (docs/benchmarks.md) puts elementwise work — RMSNorm, the SwiGLU
product, the rotary embedding, their casts and copies — at about a quarter of the GPU time. Two levers, each a
switch at load time and measured by ``benchmarks/train_step.py``:

* ``kernels``: ``"liger"`` applies liger-kernel's Triton kernels (a maintained library, the ``gpu`` extra) to the
  model instance: RMSNorm and SwiGLU where the family has them and the rotary embeddings (language model and
  vision tower), at the module classes each family names (``fused_kernel_targets``). ``"auto"`` does so where
  ``liger_kernel`` is installed and the device is a CUDA GPU, and keeps the plain path otherwise (CPU CI);
  ``"none"`` never does. Liger's cross-entropy and fused linear cross-entropy are not used: the reranker reads
  two logits, not a vocabulary-wide loss.
* ``compile_layers``: ``torch.compile`` on every decoder layer (one compiled graph shared by the layers, shapes
  dynamic so a new sequence length does not recompile every step).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .families.base import FusedKernelTargets, bind_forward

log = logging.getLogger(__name__)

KERNEL_CHOICES = ("auto", "liger", "none")


def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def resolve_kernels(choice: str, device: torch.device | str, refusal: str | None = None) -> str:
    """``"liger"`` or ``"none"`` for this device; ``"liger"`` asked for where it cannot run is a one-line error.
    ``refusal``: why the model's family refuses liger's kernels (``families.refused(family, "kernels")``):
    ``auto`` then keeps the plain path, ``liger`` is an error with that reason."""
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"model.kernels must be one of {KERNEL_CHOICES}, got {choice!r}")
    device = torch.device(device)
    if choice == "none":
        return "none"
    if choice == "auto":
        return "liger" if device.type == "cuda" and liger_installed() and refusal is None else "none"
    if refusal is not None:
        raise RuntimeError(f"model.kernels=liger: the model's family does not support it: {refusal}; "
                           "use kernels=auto or none")
    if not liger_installed():
        raise RuntimeError("model.kernels=liger needs liger-kernel (pip install 'lychee_pipeline[gpu]'); "
                           "use kernels=auto or none on this machine")
    if device.type != "cuda":
        raise RuntimeError(f"model.kernels=liger needs a CUDA GPU (Triton kernels), the device is {device.type!r}; "
                           "use kernels=auto or none")
    return "liger"


_ADDED_ATTRS = "_lychee_liger_attrs"  # the settings _to_liger_rms_norm gave a norm (removed again by remove_liger)
_STOCK = "_lychee_stock_"  # prefix under which a modelling module keeps a rotary function apply_liger replaced


def _bind(module: nn.Module, liger_cls: type) -> None:
    """Give ``module`` the forward of liger's module class ``liger_cls``, keeping its own parameters."""
    module.__dict__["forward"] = liger_cls.forward.__get__(module, type(module))
    module.__dict__["_get_name"] = lambda: liger_cls.__name__


def _to_liger_rms_norm(norm: nn.Module, liger_cls: type) -> None:
    # the settings liger's RMSNorm reads in its forward (offset, casting mode, in-place backward ...) are taken
    # from a fresh instance of it, so a liger release that adds one still finds it here
    with torch.device("meta"):  # the reference's own weight is never used
        reference = liger_cls(norm.weight.shape[0], eps=norm.variance_epsilon)
    for key, value in vars(reference).items():
        if not key.startswith("_") and key != "training":
            if key not in norm.__dict__:
                norm.__dict__.setdefault(_ADDED_ATTRS, []).append(key)
            setattr(norm, key, value)
    _bind(norm, liger_cls)


def _silu_gated(mlp: nn.Module) -> bool:
    """Whether a gate/up/down MLP computes SiLU(gate) * up (liger's SwiGLU computes exactly that)."""
    from transformers.activations import ACT2CLS

    silu_classes = tuple({ACT2CLS["silu"], ACT2CLS["swish"], nn.SiLU})
    return isinstance(getattr(mlp, "act_fn", None), silu_classes)


@dataclass(frozen=True)
class LigerPlan:
    """The module instances of one model that liger's kernels replace (found from the family's targets)."""

    rms_norms: list[nn.Module]
    swiglu_mlps: list[nn.Module]
    plain_mlps: list[nn.Module]  # gated MLPs of another activation: kept as they are (named in the log)


def liger_plan(model: nn.Module, targets: FusedKernelTargets) -> LigerPlan:
    """Every instance of the family's RMSNorm classes, and of its gated MLP classes split by activation."""
    norms = [m for m in model.modules() if isinstance(m, targets.rms_norms)]
    mlps = [m for m in model.modules() if isinstance(m, targets.gated_mlps)]
    return LigerPlan(norms, [m for m in mlps if _silu_gated(m)], [m for m in mlps if not _silu_gated(m)])


def stock_vision_rotary(modeling: Any) -> Any:
    """transformers' own ``apply_rotary_pos_emb_vision`` of the modelling module ``modeling`` (the one
    :func:`apply_liger` replaced, or the one in place)."""
    return modeling.__dict__.get(_STOCK + "apply_rotary_pos_emb_vision", modeling.apply_rotary_pos_emb_vision)


def vision_rotary_one_pass(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb_vision`` (q, k: [patches, heads, head_dim] on a CUDA device; the
    arithmetic in fp32, the result in q's dtype; the same function in Qwen2.5-VL and Qwen3-VL) through liger's
    rope kernel: one contiguous bf16 copy of q and k, then one kernel that rotates each row in fp32 and writes it
    back in q's dtype. The stock function makes about eight full-size fp32 passes over q and k (the upcast, two
    products, the rotated half's negation and concatenation, the sum, the downcast) in each of the tower's layers,
    on ~107k patches a scoring batch of 800x800 images: on one H100 the 7B tower ran 1.26x faster with this
    (docs/benchmarks.md, 2026-12-06). liger's own vision variant upcasts q and k to fp32 copies first; here cos and
    sin are fp32 and the kernel upcasts each row as it loads it. The kernel may fuse a product and a sum into one
    rounding, so an element can differ from the stock function's by one bf16 step."""
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    q4, k4 = (t.unsqueeze(0).transpose(1, 2) for t in (q, k))  # [1, heads, patches, head_dim] views
    q_out, k_out = liger_rotary_pos_emb(q4, k4, cos.float(), sin.float())
    return q_out.transpose(1, 2).squeeze(0), k_out.transpose(1, 2).squeeze(0)


def on_cuda_only(kernel: Any, stock: Any) -> Any:
    """A rotary function that runs ``kernel`` (Triton: CUDA only) on CUDA tensors and ``stock`` on others: the
    replacement is process-wide, as liger's own switches are, and a CPU model in the same process keeps
    transformers' arithmetic, bit for bit."""

    @functools.wraps(kernel)
    def rotary(q: torch.Tensor, k: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return (kernel if q.is_cuda else stock)(q, k, *args, **kwargs)

    return rotary


def vision_rotary_for(modeling: Any) -> Any:
    """The vision rotary :func:`apply_liger` puts into ``modeling``: :func:`vision_rotary_one_pass` on CUDA
    tensors, the module's stock function on others."""
    return on_cuda_only(vision_rotary_one_pass, stock_vision_rotary(modeling))


def _replace_rotary(modeling: Any, name: str, fn: Any) -> None:
    """``modeling.<name> = fn``, transformers' own function kept for :func:`remove_liger`; once per process."""
    if _STOCK + name not in modeling.__dict__:
        setattr(modeling, _STOCK + name, getattr(modeling, name))
        setattr(modeling, name, fn)


# cuBLAS's Hopper GEMM kernels need matrix rows aligned to 16 bytes. Qwen2.5-VL's vision MLP is 3,420 wide (6,840
# bytes a bf16 row): its three matmuls ran Ampere-era "align2" kernels, 61% of the 7B tower's kernel time on one
# H100. With the intermediate width zero-padded to a multiple of 64 (gate and up stacked into one matmul) the tower
# ran 0.82 s against 1.21 s on 64 images of 800x800 (docs/benchmarks.md, 2026-12-06, fourth lease). The padding
# adds exactly nothing: the padded columns are silu(0) x 0 = 0 and meet zero rows of down.
MLP_ALIGN = 64
_PADDED = "_lychee_padded_mlp"  # (the weights' identity and versions, the padded copies) on an MLP instance


def padded_mlp_weights(mlp: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(gate and up stacked, their biases, down)`` of a gate/up/down MLP with the intermediate width zero-padded
    to a multiple of :data:`MLP_ALIGN` (copies; the module's own weights are untouched)."""
    width = mlp.gate_proj.out_features
    padded = -(-width // MLP_ALIGN) * MLP_ALIGN
    weight = mlp.gate_proj.weight
    gate_up = weight.new_zeros(2 * padded, weight.shape[1])
    gate_up[:width], gate_up[padded:padded + width] = mlp.gate_proj.weight, mlp.up_proj.weight
    bias = None
    if mlp.gate_proj.bias is not None:
        bias = weight.new_zeros(2 * padded)
        bias[:width], bias[padded:padded + width] = mlp.gate_proj.bias, mlp.up_proj.bias
    down = weight.new_zeros(mlp.down_proj.out_features, padded)
    down[:, :width] = mlp.down_proj.weight
    return gate_up, bias, down


def padded_mlp_forward(mlp: nn.Module, weights: tuple, x: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` through :func:`padded_mlp_weights`: one matmul for gate and up, SiLU and
    product as the stock module computes them, then down."""
    gate_up, bias, down = weights
    padded = down.shape[1]
    both = torch.nn.functional.linear(x, gate_up, bias)
    hidden = torch.nn.functional.silu(both[..., :padded]) * both[..., padded:]
    return torch.nn.functional.linear(hidden, down, mlp.down_proj.bias)


# where pad_gated_mlps keeps the forward it replaced (liger's SwiGLU): a key of its own, so that a fast path's
# restore_forward (families.base.ORIG_FORWARD) leaves the padding and liger in place
UNPADDED_FORWARD = "_lychee_unpadded_forward"


def padded_path_holds(mlp: nn.Module) -> bool:
    """Whether ``mlp`` may score through padded copies of its weights: eval mode, frozen, and gate, up and down
    plain ``nn.Linear`` layers (a LoRA-wrapped projection would have its adapter skipped by the copies)."""
    projections = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    return (not mlp.training and all(type(lin) is nn.Linear for lin in projections)
            and not any(p.requires_grad for p in mlp.parameters()))


def padded_weights(mlp: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``mlp``'s padded copies (:func:`padded_mlp_weights`), kept on the module and made again when a weight was
    replaced or changed in place through autograd-visible ops (its storage or version counter moved)."""
    key = tuple((p.data_ptr(), p._version) for p in mlp.parameters())
    cached = mlp.__dict__.get(_PADDED)
    if cached is None or cached[0] != key:
        with torch.no_grad():
            cached = mlp.__dict__[_PADDED] = (key, padded_mlp_weights(mlp))
    return cached[1]


def _padded_or_own_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The forward :func:`pad_gated_mlps` binds: the padded copies where the MLP scores on a CUDA tensor
    (:func:`padded_path_holds`), its own forward otherwise. Elsewhere the copies are let go: in train mode a
    training step's peak memory stays what the memory model plans."""
    if x.is_cuda and padded_path_holds(self):
        return padded_mlp_forward(self, padded_weights(self), x)
    self.__dict__.pop(_PADDED, None)
    return self.__dict__[UNPADDED_FORWARD](x)


def pad_gated_mlps(mlps: list[nn.Module]) -> int:
    """Give each SiLU-gated MLP of ``mlps`` whose intermediate width is not a multiple of :data:`MLP_ALIGN` the
    padded forward (:func:`_padded_or_own_forward`; the copies are made at its first scoring call: +0.85 GB on the
    7B's vision tower); returns how many. Qwen3-VL's language-model widths are multiples of 64 already."""
    count = 0
    for mlp in mlps:
        if mlp.gate_proj.out_features % MLP_ALIGN and bind_forward(mlp, _padded_or_own_forward, UNPADDED_FORWARD):
            count += 1
    return count


def apply_liger(model: nn.Module, targets: FusedKernelTargets | None = None) -> dict[str, Any]:
    """liger-kernel's RMSNorm, SwiGLU and rope (language model and vision tower) on a loaded model of a family
    that names its targets (``families.<name>.fused_kernel_targets()``; found from the model when None), before
    LoRA is applied. Returns what was replaced, for the log.

    The modules of this model instance are switched one by one — every instance of the family's RMSNorm classes
    (Qwen2.5-VL: language model, vision blocks and merger; Qwen3-VL: language model with its per-head q/k norms)
    and every SiLU-gated MLP (Qwen2.5-VL: language model and vision blocks; Qwen3-VL: language model; its vision
    MLP is a plain GELU one) — rather than through liger's ``apply_liger_kernel_to_qwen2_5_vl`` /
    ``..._qwen3_vl``: liger-kernel 0.8.5's Qwen2.5-VL switch imports an output class that transformers 5.24
    renamed and fails with an ImportError, and its switches also replace transformers' classes for every model
    built later in the process and the model's forward (a vocabulary-wide fused loss this reranker does not use).
    The rotary functions (text and vision) are replaced in transformers' modelling module, as liger does: they are
    module-level functions, not a part of the instance; :func:`remove_liger` puts them back.

    Rotary: transformers 5.x folds the mRoPE sections into ``cos``/``sin`` inside the rotary embedding module, and
    the attention then calls the plain rotate-half ``apply_rotary_pos_emb``; liger's own Qwen2.5-VL switch
    replaces ``apply_multimodal_rotary_pos_emb``, a function these releases no longer call. So the rotate-half
    function is replaced by liger's standard rope kernel (same layout: ``cos``/``sin`` are two equal halves), and
    the multimodal one only where a transformers release still has it."""
    from liger_kernel.transformers import LigerRMSNorm, LigerSwiGLUMLP

    if targets is None:
        from .families import family_of_model

        targets = family_of_model(model).fused_kernel_targets()
    hf = targets.modeling
    plan = liger_plan(model, targets)
    for mlp in plan.swiglu_mlps:
        if "forward" not in mlp.__dict__:
            _bind(mlp, LigerSwiGLUMLP)
    padded = pad_gated_mlps(plan.swiglu_mlps)
    for norm in plan.rms_norms:
        if "forward" not in norm.__dict__:
            _to_liger_rms_norm(norm, LigerRMSNorm)
    if hasattr(hf, "apply_multimodal_rotary_pos_emb"):  # releases that apply mRoPE in the attention
        from liger_kernel.transformers.qwen2vl_mrope import liger_multimodal_rotary_pos_emb

        _replace_rotary(hf, "apply_multimodal_rotary_pos_emb",
                        on_cuda_only(liger_multimodal_rotary_pos_emb, hf.apply_multimodal_rotary_pos_emb))
        rope = "multimodal"
    else:  # mRoPE folded into cos/sin: the attention calls the rotate-half function
        from liger_kernel.transformers.rope import liger_rotary_pos_emb

        _replace_rotary(hf, "apply_rotary_pos_emb", on_cuda_only(liger_rotary_pos_emb, hf.apply_rotary_pos_emb))
        rope = "rotate-half"
    _replace_rotary(hf, "apply_rotary_pos_emb_vision", vision_rotary_for(hf))
    done = {"rms_norm_modules": len(plan.rms_norms), "swiglu_modules": len(plan.swiglu_mlps),
            "rope": f"{rope} and vision", "padded_mlps": padded}
    if plan.plain_mlps:
        done["mlps_kept_plain"] = f"{len(plan.plain_mlps)} (not SiLU-gated)"
    return done


def remove_liger(model: nn.Module, targets: FusedKernelTargets | None = None) -> int:
    """Undo :func:`apply_liger` (the benchmarks time both on one model): the instances take their class's forward
    again and the modelling module its stock rotary functions. Returns how many modules were switched back."""
    if targets is None:
        from .families import family_of_model

        targets = family_of_model(model).fused_kernel_targets()
    switched = [m for m in model.modules() if "forward" in m.__dict__ and m._get_name().startswith("Liger")]
    for module in switched:
        for key in ("forward", "_get_name", UNPADDED_FORWARD, _PADDED, *module.__dict__.pop(_ADDED_ATTRS, [])):
            module.__dict__.pop(key, None)
    hf = targets.modeling
    for key in [k for k in hf.__dict__ if k.startswith(_STOCK)]:
        setattr(hf, key[len(_STOCK):], hf.__dict__.pop(key))
    return len(switched)


def compile_decoder_layers(model: nn.Module) -> int:
    """``torch.compile`` every language-model decoder layer (in place); returns how many."""
    import torch._dynamo

    from .families import family_of_model

    layers = family_of_model(model).decoder_layers(model)
    # one layer code object meets several guard sets (training / eval, with and without checkpointing, packed or
    # padded inputs); past dynamo's default limit of 8 it would silently run the layers uncompiled
    name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, name, max(int(getattr(torch._dynamo.config, name)), 64))
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


def avoid_cudnn_attention(device: torch.device | str) -> bool:
    """Keep SDPA off cuDNN attention on CUDA (process-wide; flash and memory-efficient kernels remain).

    cuDNN attention builds an execution plan for every new sequence shape. Training and scoring batches change
    shape at nearly every step (length-sorted, packed or padded to the longest pair), so it planned on the host
    again and again: on one H200 a packed 7B step ran at 4.4 pairs/s with it and 11.7 without, a padded one at
    9.0 vs 9.8, and a real packed stage at 0.34 of the isolated step (docs/benchmarks.md, 2026-12-03).
    Returns whether it changed anything."""
    if torch.device(device).type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    log.info("SDPA: cuDNN attention off (it plans each new shape; flash / memory-efficient kernels used)")
    return True


def fused_kernels_applied(model: nn.Module) -> bool:
    """Whether liger's fused SwiGLU runs in ``model`` (``apply_liger`` switched its MLPs): the memory model's
    packed-and-fused regime (training/memory.py) depends on it."""
    return any(m._get_name() == "LigerSwiGLUMLP" for m in model.modules())


def apply_kernels(model: nn.Module, choice: str, device: torch.device | str, family: Any = None) -> str:
    """Resolve ``model.kernels`` for ``device`` and the model's ``family`` (found from the model when None) and
    apply it; logs the outcome once. Returns ``"liger"``/``"none"``."""
    from .families import family_of_model, refused

    family = family or family_of_model(model)
    kind = resolve_kernels(choice, device, refused(family, "kernels"))
    avoid_cudnn_attention(device)
    if kind == "liger":
        from importlib.metadata import version

        done = apply_liger(model, family.fused_kernel_targets())
        log.info("fused kernels: liger-kernel %s (%d RMSNorm, %d SwiGLU modules of which %d padded to a multiple of "
                 "%d for scoring, %s rope%s)", version("liger-kernel"), done["rms_norm_modules"], done["swiglu_modules"],
                 done["padded_mlps"], MLP_ALIGN, done["rope"],
                 f"; MLPs kept plain: {done['mlps_kept_plain']}" if "mlps_kept_plain" in done else "")
    else:
        why = ("asked for" if choice == "none" else "not installed" if not liger_installed()
               else "not a CUDA device" if torch.device(device).type != "cuda"
               else f"the family refuses it: {refused(family, 'kernels')}")
        log.info("fused kernels: none (kernels=%s, %s): plain PyTorch path", choice, why)
    return kind
