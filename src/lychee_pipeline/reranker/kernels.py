"""Fused kernels and compiled decoder layers for the Qwen2.5-VL reranker (``model.kernels``, ``model.compile_layers``).

The profile of the project's training step (docs/benchmarks.md) puts elementwise work — RMSNorm, the SwiGLU
product, the rotary embedding, their casts and copies — at about a quarter of the GPU time. Two levers, each a
switch at load time and measured by ``benchmarks/train_step.py``:

* ``kernels``: ``"liger"`` applies liger-kernel's Triton kernels (a maintained library, the ``gpu`` extra) to the
  model instance: RMSNorm and SwiGLU (language model and vision blocks) and the rotary embeddings (language model
  and vision tower). ``"auto"`` does so where ``liger_kernel`` is installed and the device is a CUDA GPU, and keeps
  the plain path otherwise (CPU CI); ``"none"`` never does. Liger's cross-entropy and fused linear cross-entropy
  are not used: the reranker reads two logits, not a vocabulary-wide loss.
* ``compile_layers``: ``torch.compile`` on every decoder layer (one compiled graph shared by the layers, shapes
  dynamic so a new sequence length does not recompile every step).

Rotary embedding: transformers 5.x folds Qwen2.5-VL's mRoPE sections into ``cos``/``sin`` inside the rotary
embedding module, and the attention then calls the plain rotate-half ``apply_rotary_pos_emb``; liger's own
Qwen2.5-VL switch replaces ``apply_multimodal_rotary_pos_emb``, a function these releases no longer call. So the
rotate-half function is replaced by liger's standard rope kernel (same layout: ``cos``/``sin`` are two equal
halves), and the multimodal one only where a transformers release still has it. The vision tower's rotary
function gets the same kernel (:func:`vision_rotary_one_pass`).
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import torch
from torch import nn

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
            setattr(norm, key, value)
    _bind(norm, liger_cls)


def stock_vision_rotary() -> Any:
    """transformers' own ``apply_rotary_pos_emb_vision`` of Qwen2.5-VL (kept when :func:`apply_liger` replaces it)."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf

    return hf.__dict__.get("_lychee_stock_vision_rotary", hf.apply_rotary_pos_emb_vision)


def vision_rotary_one_pass(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb_vision`` (q, k: [patches, heads, head_dim]; the arithmetic in fp32, the
    result in q's dtype) through liger's rope kernel: one contiguous bf16 copy of q and k, then one kernel that
    rotates each row in fp32 and writes it back in q's dtype. The stock function makes about eight full-size fp32
    passes over q and k (the upcast, two products, the rotated half's negation and concatenation, the sum, the
    downcast) in each of the tower's layers, on ~107k patches a scoring batch of 800x800 images: on one H100 the
    7B tower ran 1.26x faster with this (docs/benchmarks.md, 2026-12-06). liger's own vision variant upcasts q and
    k to fp32 copies first; here cos and sin are fp32 and the kernel upcasts each row as it loads it. The kernel
    may fuse a product and a sum into one rounding, so an element can differ from the stock function's by one
    bf16 step."""
    if not q.is_cuda:  # the replacement is process-wide (as liger's own switches are): a CPU model keeps the stock one
        return stock_vision_rotary()(q, k, cos, sin)
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    q4, k4 = (t.unsqueeze(0).transpose(1, 2) for t in (q, k))  # [1, heads, patches, head_dim] views
    q_out, k_out = liger_rotary_pos_emb(q4, k4, cos.float(), sin.float())
    return q_out.transpose(1, 2).squeeze(0), k_out.transpose(1, 2).squeeze(0)


def apply_liger(model: nn.Module) -> dict[str, Any]:
    """liger-kernel's RMSNorm, SwiGLU and rope (language model and vision tower) on a loaded
    ``Qwen2_5_VLForConditionalGeneration`` (before LoRA is applied). Returns what was replaced, for the log.

    The modules of this model instance are switched one by one (the language model's norms and MLPs, the vision
    blocks' norms: what liger's own Qwen2.5-VL switch does to an instance; and the vision blocks' MLPs) rather
    than through ``apply_liger_kernel_to_qwen2_5_vl``: liger-kernel 0.8.5's switch imports an output class that
    transformers 5.24 renamed and fails with an ImportError, and it also replaces transformers' norm and MLP
    classes for every model built later in the process. The rotary functions (text and vision) are still replaced
    in transformers' module (below), as liger does: they are module-level functions, not a part of the instance.
    It knows Qwen2.5-VL's modules only: a family whose modules it does not know refuses ``kernels``
    (``REFUSED_FAST_PATHS``)."""
    from liger_kernel.transformers import LigerRMSNorm, LigerSwiGLUMLP
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf

    holders = (hf.Qwen2_5_VLDecoderLayer, hf.Qwen2_5_VLTextModel, hf.Qwen2_5_VLVisionBlock)  # modules with norms
    for module in model.modules():
        if isinstance(module, hf.Qwen2_5_VLDecoderLayer):
            if module.mlp.config.hidden_act not in ("silu", "swish"):  # liger's SwiGLU computes SiLU
                raise ValueError(f"model.kernels=liger: the MLP activation is {module.mlp.config.hidden_act!r}, "
                                 "liger's SwiGLU needs silu; use model.kernels: none")
            _bind(module.mlp, LigerSwiGLUMLP)
        if isinstance(module, hf.Qwen2_5_VisionTransformerPretrainedModel) and module.config.hidden_act in (
                "silu", "swish"):  # the vision blocks' MLPs are the same gated class, with biases
            for block in module.blocks:
                _bind(block.mlp, LigerSwiGLUMLP)
        if isinstance(module, holders):
            for name in ("input_layernorm", "post_attention_layernorm", "norm", "norm1", "norm2"):
                norm = getattr(module, name, None)
                if isinstance(norm, hf.Qwen2_5_VLRMSNorm):
                    _to_liger_rms_norm(norm, LigerRMSNorm)
    if hasattr(hf, "apply_multimodal_rotary_pos_emb"):  # releases that apply mRoPE in the attention
        from liger_kernel.transformers.qwen2vl_mrope import liger_multimodal_rotary_pos_emb

        hf.apply_multimodal_rotary_pos_emb = liger_multimodal_rotary_pos_emb
        rope = "multimodal"
    else:  # mRoPE folded into cos/sin: the attention calls the rotate-half function
        from liger_kernel.transformers.rope import liger_rotary_pos_emb

        hf.apply_rotary_pos_emb = liger_rotary_pos_emb
        rope = "rotate-half"
    if hf.apply_rotary_pos_emb_vision is not vision_rotary_one_pass:
        hf._lychee_stock_vision_rotary = hf.apply_rotary_pos_emb_vision
        hf.apply_rotary_pos_emb_vision = vision_rotary_one_pass
    norms = sum(1 for m in model.modules() if m._get_name() == "LigerRMSNorm")
    mlps = sum(1 for m in model.modules() if m._get_name() == "LigerSwiGLUMLP")
    return {"rms_norm_modules": norms, "swiglu_modules": mlps, "rope": f"{rope} and vision"}


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

    refusal = refused(family or family_of_model(model), "kernels")
    kind = resolve_kernels(choice, device, refusal)
    avoid_cudnn_attention(device)
    if kind == "liger":
        from importlib.metadata import version

        done = apply_liger(model)
        log.info("fused kernels: liger-kernel %s (%d RMSNorm, %d SwiGLU modules, %s rope)", version("liger-kernel"),
                 done["rms_norm_modules"], done["swiglu_modules"], done["rope"])
    else:
        why = ("asked for" if choice == "none" else "not installed" if not liger_installed()
               else "not a CUDA device" if torch.device(device).type != "cuda" else f"the family refuses it: {refusal}")
        log.info("fused kernels: none (kernels=%s, %s): plain PyTorch path", choice, why)
    return kind
