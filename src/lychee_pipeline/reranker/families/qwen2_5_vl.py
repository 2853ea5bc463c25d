"""The Qwen2.5-VL family: all the reranker library knows about Qwen2.5-VL, behind the functions of
:class:`~lychee_pipeline.reranker.families.ModelFamily`.

- **Model and architecture**: :func:`model_class`, and :func:`architecture_config` for the published 7B or the
  ``tiny`` miniature that ``builtin:tiny`` is built with (the GPU benchmarks build both with it).
- **Processor**: the stock one, or :class:`LycheeProcessor` where torchvision is missing (the class is created on
  first use, not at import); saving; :func:`image_tokens`, the processor's resize rule (``smart_resize``).
- **The tiny recipe**: Qwen's special tokens and chat template layout, a byte-level BPE with Qwen2's
  pre-tokenization, random weights from a seed (:func:`build_tiny`; ``reranker/tiny.py`` caches the folder).
- **Fast path**: batched vision windows and a frozen tower without autograd (:func:`enable_fast_path`), and
  checkpointing of some decoder layers only (:func:`apply_selective_checkpointing`).

Importing this module costs torch only; transformers is imported by the functions that use it.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import types
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------
# architecture

# Qwen2.5-VL-7B-Instruct's vocabulary size and special token ids (its published tokenizer)
VOCAB_SIZE = 152064
TOKEN_IDS = {
    "image_token_id": 151655,  # <|image_pad|>
    "video_token_id": 151656,  # <|video_pad|>
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "pad_token_id": 151643,  # <|endoftext|>, also the bos id
    "eos_token_id": 151645,  # <|im_end|>
}

# The tokens behind those ids, for a tokenizer of another vocabulary (builtin:tiny's)
TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "pad_token_id": "<|endoftext|>",
    "eos_token_id": "<|im_end|>",
}

# Text and vision dimensions by size; the vision tower's output width is the text hidden size.
ARCHITECTURES: dict[str, dict[str, dict[str, Any]]] = {
    "7b": {  # Qwen2.5-VL-7B-Instruct, as published
        "text": {
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "max_position_embeddings": 128000,
            "rope_theta": 1e6,
            "mrope_section": [16, 24, 24],
            "rms_norm_eps": 1e-6,
        },
        "vision": {
            "depth": 32,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
        },
    },
    "tiny": {  # builtin:tiny, a miniature with every code path of the 7B
        "text": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 8192,
            "rope_theta": 1000000.0,
            # head_dim = 64 / 4 = 16; mRoPE sections (temporal, height, width) must sum to head_dim / 2
            "mrope_section": [2, 3, 3],
            "rms_norm_eps": 1e-6,
        },
        "vision": {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [1],
        },
    },
}


def model_class() -> type:
    """``Qwen2_5_VLForConditionalGeneration``."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration


def token_ids_of(tokenizer: Any) -> dict[str, int]:
    """The :data:`TOKEN_IDS` of ``tokenizer``: what :func:`architecture_config` takes for a model of its vocabulary."""
    return {key: int(tokenizer.convert_tokens_to_ids(token)) for key, token in TOKENS.items()}


def architecture_config(size: str, vocab_size: int | None = None, token_ids: dict[str, int] | None = None):
    """``Qwen2_5_VLConfig`` of ``size`` (``"7b"`` or ``"tiny"``), for random initialisation.

    ``vocab_size`` and ``token_ids`` (keys of :data:`TOKEN_IDS`) default to Qwen2.5-VL-7B-Instruct's; a model
    with its own tokenizer (``builtin:tiny``) passes that tokenizer's.
    """
    from transformers import Qwen2_5_VLConfig

    if size not in ARCHITECTURES:
        raise ValueError(f"unknown Qwen2.5-VL size {size!r}; known: {', '.join(ARCHITECTURES)}")
    unknown = sorted(set(token_ids or {}) - set(TOKEN_IDS))
    if unknown:
        raise ValueError(f"unknown token ids {unknown}; known: {sorted(TOKEN_IDS)}")
    ids = {**TOKEN_IDS, **(token_ids or {})}
    t, v = ARCHITECTURES[size]["text"], ARCHITECTURES[size]["vision"]
    special = {"bos_token_id": ids["pad_token_id"], "eos_token_id": ids["eos_token_id"],
               "pad_token_id": ids["pad_token_id"]}
    return Qwen2_5_VLConfig(
        text_config={
            "vocab_size": vocab_size or VOCAB_SIZE,
            "hidden_size": t["hidden_size"],
            "intermediate_size": t["intermediate_size"],
            "num_hidden_layers": t["num_hidden_layers"],
            "num_attention_heads": t["num_attention_heads"],
            "num_key_value_heads": t["num_key_value_heads"],
            "max_position_embeddings": t["max_position_embeddings"],
            "rms_norm_eps": t["rms_norm_eps"],
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": t["rope_theta"],
                "mrope_section": list(t["mrope_section"]),
            },
            **special,
            "tie_word_embeddings": False,
        },
        vision_config={**v, "out_hidden_size": t["hidden_size"],
                       "fullatt_block_indexes": list(v["fullatt_block_indexes"])},
        # token ids are top-level fields and must match the tokenizer
        image_token_id=ids["image_token_id"],
        video_token_id=ids["video_token_id"],
        vision_start_token_id=ids["vision_start_token_id"],
        vision_end_token_id=ids["vision_end_token_id"],
        **special,
        tie_word_embeddings=False,
    )


# ----------------------------------------------------------------------------------------------
# processor


@functools.cache
def processor_shim_class() -> type:
    """:class:`LycheeProcessor`, created on the first call (it subclasses a transformers processor)."""
    from transformers import Qwen2_5_VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class LycheeProcessor(Qwen2_5_VLProcessor):
        """Qwen2.5-VL processor with only the image processor and the tokenizer.

        Used where torchvision is missing: transformers' video processor needs it, and the stock
        processor cannot be built without one. Images + text produce the same inputs as the stock one.
        """

        attributes = ["image_processor", "tokenizer"]  # read by older transformers; newer ones use __init__

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
            self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
            self.image_token_id = getattr(tokenizer, "image_token_id", None) or tokenizer.convert_tokens_to_ids(
                self.image_token
            )
            self.video_token_id = getattr(tokenizer, "video_token_id", None) or tokenizer.convert_tokens_to_ids(
                self.video_token
            )
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

    LycheeProcessor.__qualname__ = "LycheeProcessor"  # pickled by reference as this module's attribute
    return LycheeProcessor


def __getattr__(name: str) -> Any:
    # LycheeProcessor subclasses a transformers processor: created on first use (importing it takes seconds)
    if name == "LycheeProcessor":
        return processor_shim_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def save_processor(processor: Any, out_dir: str | os.PathLike) -> None:
    """Save a processor so that the folder looks like a stock Qwen2.5-VL one."""
    out = Path(out_dir)
    processor.save_pretrained(out)
    # the legacy flat image-processor file, as stock Qwen2.5-VL folders have it: transformers builds the
    # video processor from it when torchvision is installed (and older releases read only this file)
    processor.image_processor.save_pretrained(out)
    for path in out.glob("*.json"):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(data, dict) and data.get("processor_class") == "LycheeProcessor":
            data["processor_class"] = "Qwen2_5_VLProcessor"
            path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def image_processor_kind(processor: Any) -> str:
    """``"fast"`` when the processor resizes and normalises with torchvision (tensor ops, the faster host path),
    ``"pil"`` for the PIL/numpy one (what a machine without torchvision gets)."""
    names = {cls.__name__ for cls in type(processor.image_processor).__mro__}
    fast = any(n.endswith("Fast") for n in names) or "TorchvisionBackend" in names
    return "fast" if fast else "pil"


def load_processor(path: str, local_files_only: bool = False) -> Any:
    """AutoProcessor with the fast (torchvision) image processor when torchvision is importable, else
    :class:`LycheeProcessor` (images + text, PIL image processor). Which one loaded is logged."""
    import warnings

    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    kwargs = {"trust_remote_code": False, "local_files_only": local_files_only}
    if is_torchvision_available():
        with warnings.catch_warnings():  # newer transformers: fast is the default and the flag is deprecated
            warnings.simplefilter("ignore")
            processor = AutoProcessor.from_pretrained(path, use_fast=True, **kwargs)
    else:
        processor = processor_shim_class().from_pretrained(path, **kwargs)
    log.info("image processor: %s (%s)", type(processor.image_processor).__name__, image_processor_kind(processor))
    tok = processor.tokenizer
    if tok.padding_side != "left":
        tok.padding_side = "left"
    return processor


def image_tokens(processor: Any, height: int, width: int, min_pixels: int, max_pixels: int) -> int:
    """LM tokens one image of ``height`` x ``width`` becomes under the pixel budget (the processor's own rule:
    resized to a multiple of patch x merge within the budget, one token per merge x merge patches)."""
    ip = processor.image_processor
    merge = int(getattr(ip, "merge_size", 2))
    budget = {"min_pixels": min_pixels, "max_pixels": max_pixels}
    if hasattr(ip, "get_number_of_image_patches"):
        patches = ip.get_number_of_image_patches(height, width, budget)
    else:  # pragma: no cover - very old processors; the processor check in PairCollator.encode guards this
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        patch = int(getattr(ip, "patch_size", 14))
        h, w = smart_resize(height, width, patch * merge, **budget)
        patches = (h // patch) * (w // patch)
    return int(patches) // (merge**2)


def image_processor_class() -> type:
    """The PIL/numpy Qwen2-VL image processor class of this transformers (what builtin:tiny saves)."""
    import transformers

    # transformers >= 5.2x names the PIL backend *Pil; older 5.x has the PIL/numpy class unsuffixed.
    for name in ("Qwen2VLImageProcessorPil", "Qwen2VLImageProcessor"):
        cls = getattr(transformers, name, None)
        if cls is not None:
            try:
                cls()
            except ImportError:
                continue
            return cls
    raise ImportError("no usable Qwen2-VL image processor class in this transformers")


# ----------------------------------------------------------------------------------------------
# the tiny recipe (builtin:tiny): Qwen's tokens and template on a miniature of the architecture

# Qwen's special tokens, in Qwen's order (ids differ from the real model: the vocabulary is tiny).
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# A chat template that renders messages of text and images exactly as Qwen2.5-VL-Instruct's does
# (system message default, image placeholders wrapped in vision start/end, generation prompt).
CHAT_TEMPLATE = (
    "{% set ns = namespace(images=0, videos=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n"
    "{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{% set ns.images = ns.images + 1 %}"
    "{% if add_vision_id %}Picture {{ ns.images }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "{% set ns.videos = ns.videos + 1 %}"
    "{% if add_vision_id %}Video {{ ns.videos }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}"
    "{{ part['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "<|im_start|>assistant\n"
    "{% endif %}"
)

# Everything of this family that determines the tiny folder (reranker/tiny.py hashes it into its marker).
TINY_RECIPE: dict[str, Any] = {
    "bpe_vocab_size": 1200,
    "text": ARCHITECTURES["tiny"]["text"],
    "vision": ARCHITECTURES["tiny"]["vision"],
    "image": {"min_pixels": 4 * 28 * 28, "max_pixels": 1280 * 28 * 28},
    "chat_template": CHAT_TEMPLATE,
}


def build_tiny_tokenizer(corpus: list[str]):
    """A Qwen2 tokenizer whose byte-level BPE is trained on ``corpus`` with Qwen2's own pre-tokenization,
    with Qwen's special tokens and chat template; ``yes`` and ``no`` are whole tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import AddedToken
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

    # Train a byte-level BPE with Qwen2's own pre-tokenization (regex split + byte level, NFC).
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.normalizer = normalizers.NFC()
    trainer_tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer_tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_RECIPE["bpe_vocab_size"],
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    trainer_tok.train_from_iterator(corpus, trainer=trainer)
    state = json.loads(trainer_tok.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["model"]["merges"]]
    for word in ("yes", "no"):
        if word not in vocab:
            raise RuntimeError(f"tiny tokenizer recipe bug: {word!r} is not a whole token")
    base = len(vocab)
    for i, token in enumerate(SPECIAL_TOKENS):
        vocab[token] = base + i

    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",  # must be given here: setting it later is not saved
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS], special_tokens=True)
    tok.chat_template = CHAT_TEMPLATE
    for token in SPECIAL_TOKENS:
        ids = tok.encode(token, add_special_tokens=False)
        if ids != [vocab[token]]:
            raise RuntimeError(f"tiny tokenizer recipe bug: {token} encodes to {ids}")
    return tok


def build_tiny(out: Path, corpus: list[str], seed: int) -> None:
    """Save the tiny model (random weights from ``seed``, fp32, safetensors) and its processor into ``out``."""
    tok = build_tiny_tokenizer(corpus)
    padded_vocab = (len(tok) + 63) // 64 * 64
    config = architecture_config("tiny", padded_vocab, token_ids_of(tok))
    torch.manual_seed(seed)
    model = model_class()(config).to(torch.float32).eval()
    model.save_pretrained(out)

    v = TINY_RECIPE["vision"]
    image_processor = image_processor_class()(
        size={"shortest_edge": TINY_RECIPE["image"]["min_pixels"], "longest_edge": TINY_RECIPE["image"]["max_pixels"]},
        patch_size=v["patch_size"],
        temporal_patch_size=v["temporal_patch_size"],
        merge_size=v["spatial_merge_size"],
    )
    processor = processor_shim_class()(image_processor=image_processor, tokenizer=tok, chat_template=CHAT_TEMPLATE)
    save_processor(processor, out)


# ----------------------------------------------------------------------------------------------
# the fast path, numerically equal to the stock one
#
# Two problems of the stock Hugging Face path (transformers 5.17 - 5.23) at the Lychee shape (8 pairs,
# one 448x448 image each), and what the fast path does about them (docs/benchmarks.md has the figures):
#
# 1. Vision attention, one kernel call per window. Without flash-attn, ``Qwen2_5_VLVisionAttention``
#    splits the packed sequence at ``cu_seqlens`` and runs one SDPA call per window per layer (8 images
#    x 16 windows x 28 window layers = 3,584 tiny calls a step), plus one ``.tolist()`` device sync per
#    layer. :func:`enable_fast_path` replaces the forward of every vision attention module by one that
#    groups the segments by length and runs one SDPA call per distinct length (all windows of a
#    448x448 image have 64 patches: one call of batch 128 instead of 128 calls). The same attention
#    function, the same scaling and the same rotary code are used; each (window, head) is still
#    computed on its own, so the result equals the stock path (checked in
#    ``tests/reranker/test_fast_vision.py``). The segment plan is computed once per ``cu_seqlens``
#    tensor (one host sync per forward instead of one per layer).
#
# 2. The frozen vision tower recorded by autograd. Enabling activation checkpointing calls
#    ``enable_input_require_grads``, which hooks every input-embedding layer, the vision tower's
#    ``patch_embed`` included: the frozen tower is then recorded, checkpointed, recomputed and
#    back-propagated through in every step, for gradients nobody uses. The fast path runs the vision
#    tower under ``torch.no_grad()`` whenever none of its parameters requires a gradient.
#
# :func:`apply_selective_checkpointing` checkpoints only some of the language model's decoder layers
# (memory for speed), and :func:`checkpoint_layers_for_budget` picks that number from a memory budget.
# Nothing here changes parameters or saved weights.

_PLAN_ATTR = "_lychee_segment_plan"
_ORIG_FORWARD = "_lychee_orig_forward"


# ----------------------------------------------------------------------------------------------
# segment plan: which rows of the packed sequence form same-length groups


@dataclass
class _Group:
    length: int  # tokens per segment
    count: int  # segments in the group
    start: int | None  # first row, when the group's segments are one contiguous run
    index: torch.Tensor | None  # row indices [count * length] otherwise

    def rows_on(self, device: torch.device) -> torch.Tensor:
        """The row indices on ``device`` (a prepared batch's plan has them there already, see
        :func:`map_segment_rows`; otherwise they are copied here)."""
        return self.index if self.index.device == device else self.index.to(device, non_blocking=True)


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


def map_segment_rows(inputs: dict[str, Any], fn) -> dict[str, Any]:
    """``inputs`` with every segment-bound tensor's plan given row indices ``fn(index)`` (page-locked, moved to a
    device), on a new handle of the same bounds: the plan built on the host stays as it was."""
    mapped = dict(inputs)
    for key, value in inputs.items():
        plan = getattr(value, _PLAN_ATTR, None) if isinstance(value, torch.Tensor) else None
        if plan is not None:
            handle = value.view_as(value)
            setattr(handle, _PLAN_ATTR, [g if g.index is None else replace(g, index=fn(g.index)) for g in plan])
            mapped[key] = handle
    return mapped


def vision_inputs_on_host(vision_config: Any, image_grid_thw: torch.Tensor) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the vision tower derives from the image grids alone, computed on the host: ``(to the device, stays
    on the host)``, passed to its forward as precomputed keyword arguments (transformers' ``vision_utils``).

    Computed in the tower's own forward, these are Python loops over ``grid_thw.tolist()`` on a device tensor,
    each a device sync. To the device: the rotary positions and the window order. On the host: the segment
    bounds (full and windowed attention) with their segment plans built here, so the batched attention never
    reads them back, and their longest segments.
    """
    from transformers import vision_utils

    grid = image_grid_thw.cpu()
    merge = vision_config.spatial_merge_size
    window_index, cu_window_seqlens = vision_utils.get_vision_window_index(
        grid, spatial_merge_size=merge, window_size=vision_config.window_size, patch_size=vision_config.patch_size)
    cu_seqlens = vision_utils.get_vision_cu_seqlens(grid)
    for cu in (cu_seqlens, cu_window_seqlens):
        segment_plan(cu)
    to_device = {"position_ids": vision_utils.get_vision_position_ids(grid, merge), "window_index": window_index}
    on_host = {"cu_seqlens": cu_seqlens, "cu_window_seqlens": cu_window_seqlens,
               "max_seqlen": int((cu_seqlens[1:] - cu_seqlens[:-1]).max()),
               "max_window_seqlen": int((cu_window_seqlens[1:] - cu_window_seqlens[:-1]).max())}
    return to_device, on_host


# ----------------------------------------------------------------------------------------------
# the batched vision attention


def _hf_modeling():  # transformers' Qwen2.5-VL modelling module
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
    hf = _hf_modeling()
    if hf.is_flash_attention_requested(self.config):  # flash-attn is already variable-length: keep it
        cu_seqlens = cu_seqlens.to(hidden_states.device, non_blocking=True)  # prepared on the host
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
                rows = g.rows_on(hidden_states.device)
                picked = [t.index_select(0, rows) for t in (query_states, key_states, value_states)]
                attn_output.index_copy_(0, rows, attend(*picked, g.count, g.length))

    return self.proj(attn_output.contiguous())


# ----------------------------------------------------------------------------------------------
# enabling / disabling


def _vision_classes():
    hf = _hf_modeling()
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
    return [m for m in model.modules() if isinstance(m, _hf_modeling().Qwen2_5_VLDecoderLayer)]


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
