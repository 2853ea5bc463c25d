"""``model.fp8: true``: the language model's linear layers run their matmuls in FP8 (torchao's float8).

Hopper GPUs (CUDA capability 9.x: H100, H200) have FP8 tensor cores at twice the bf16 rate. torchao's
``convert_to_float8_training`` swaps each chosen ``nn.Linear`` for a ``Float8Linear``: inputs and weights are cast
to float8 e4m3 with a dynamic per-tensor scale before the matmul (and the output gradient to e5m2 in the
backward), the weights themselves stay in bf16. It covers scoring (forward only) and LoRA training: the frozen
base weights of the attention and MLP projections run in FP8, the LoRA adapters peft puts around them stay in
bf16 (they are applied to the Float8Linear base layer as to any ``nn.Linear``). The vision tower and the
``lm_head`` rows that score yes/no stay in bf16 (the tower's patch merger and the score are where precision shows
first). The casts are separate kernels unless the layers are compiled (``model.compile_layers: true``).

Off by default: it changes the numbers (the benchmark reports its differences against fp32 beside bf16's own,
``benchmarks/inference.py --fp8``). Refused in one line on a CPU, a non-Hopper GPU or without torchao (the
``gpu`` extra).
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

# FP8 matmuls (torch._scaled_mm) need both dimensions divisible by 16
_ALIGNMENT = 16


def fp8_refusal(device: torch.device, finetune: str) -> str | None:
    """Why ``model.fp8: true`` cannot run here (one line), or None."""
    if finetune == "qlora":
        return "model.fp8 and finetune: qlora both quantize the base weights; set model.fp8: false or finetune: lora"
    if device.type != "cuda" or not torch.cuda.is_available():
        return (f"model.fp8 needs a Hopper GPU (CUDA capability 9.x: H100, H200); the device is {device.type!r}; "
                "set model.fp8: false")
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    if major != 9:
        return (f"model.fp8 needs a Hopper GPU (CUDA capability 9.x: H100, H200); "
                f"{torch.cuda.get_device_name(index)} has {major}.{minor}; set model.fp8: false")
    if importlib.util.find_spec("torchao") is None:
        return "model.fp8 needs torchao (pip install 'lychee_pipeline[gpu]'); or set model.fp8: false"
    return None


def require_fp8(device: torch.device, finetune: str) -> None:
    reason = fp8_refusal(device, finetune)
    if reason is not None:
        raise RuntimeError(reason)


def fp8_linear_filter(language_models: list[nn.Module]):
    """``module_filter_fn`` for torchao: the ``nn.Linear`` layers inside the language model(s), both dimensions
    divisible by 16; nothing of the vision tower, the embeddings or ``lm_head``, and no LoRA adapter (a model that
    peft has wrapped already keeps its adapters in bf16)."""
    chosen = {id(m) for lm in language_models for m in lm.modules() if isinstance(m, nn.Linear)}

    def keep(module: nn.Module, name: str) -> bool:
        return (id(module) in chosen and "lora_" not in name and module.in_features % _ALIGNMENT == 0
                and module.out_features % _ALIGNMENT == 0)

    return keep


def apply_fp8(model: nn.Module, language_models: list[nn.Module], emulate: bool = False) -> int:
    """Swap the language model's linear layers for torchao ``Float8Linear`` (in place); returns how many.
    ``emulate``: torchao's emulation (float8 rounding, matmul in high precision), for checking the path on a CPU."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    # pad_inner_dim: the weight gradient's matmul runs over the tokens, and _scaled_mm needs its inner dimension a
    # multiple of 16, which a packed batch's token count rarely is (7,082 tokens failed the first H100 step).
    # torchao computes that gradient even for LoRA's frozen base weights.
    convert_to_float8_training(model, module_filter_fn=fp8_linear_filter(language_models),
                               config=Float8LinearConfig(emulate=emulate, pad_inner_dim=True))
    count = sum(isinstance(m, Float8Linear) for m in model.modules())
    log.info("model.fp8: %d linear layers of the language model run FP8 matmuls (torchao float8, dynamic "
             "per-tensor scales)%s", count, " [emulated]" if emulate else "")
    return count
