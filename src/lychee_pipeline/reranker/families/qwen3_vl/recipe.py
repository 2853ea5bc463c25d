"""The Qwen3-VL recipe: the 2B, 8B and ``tiny`` configs from one table, and the ``builtin:tiny-qwen3-vl`` miniature.

- :data:`ARCHITECTURES`: text and vision dimensions of Qwen3-VL-2B / -8B (the backbones of Qwen3-VL-Reranker-2B /
  -8B) and of ``tiny`` (every code path of the real ones — DeepStack, interleaved mRoPE, patch 16, merge 2 — at a
  size a CPU trains); :func:`architecture_config` makes the transformers config (the GPU benchmarks build them).
- The tiny recipe (:data:`TINY_RECIPE`): Qwen's special tokens, a Qwen3-VL chat template, the Qwen2-VL image
  processor at patch 16 / merge 2 with Qwen3-VL's normalisation, random weights from a seed (:func:`build_tiny`).

Where the published numbers come from: the ``config.json`` files of Qwen/Qwen3-VL-2B-Instruct and
Qwen/Qwen3-VL-8B-Instruct on the Hugging Face hub (the rerankers' backbones; no hub is reachable here, so they
were not re-read on this machine). The 8B vision tower is transformers' ``Qwen3VLVisionConfig`` default
(depth 27, hidden 1152, intermediate 4304, DeepStack [8, 16, 24]); the 2B vision tower (depth 24, hidden 1024,
intermediate 4096, DeepStack [5, 11, 17]) matches sgl-jax's ``Qwen3VLVisionConfig`` defaults for the 2B.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..qwen2_5_vl.processor import image_processor_class
from ..qwen2_5_vl.recipe import (SPECIAL_TOKENS, TOKEN_IDS, TOKENS, build_tiny_tokenizer, qwen_vl_chat_template,
                                 token_ids_of)
from .model import model_class
from .processor import processor_shim_class, save_processor

VOCAB_SIZE = 151936  # Qwen3-VL's embedding rows (the token ids of TOKEN_IDS are the same as Qwen2.5-VL's)

# Qwen3-VL's image normalisation (Qwen2.5-VL uses the CLIP mean/std)
IMAGE_MEAN = [0.5, 0.5, 0.5]
IMAGE_STD = [0.5, 0.5, 0.5]

ARCHITECTURES: dict[str, dict[str, dict[str, Any]]] = {
    "2b": {  # Qwen3-VL-2B-Instruct's config.json (hub), the backbone of Qwen3-VL-Reranker-2B
        "text": {
            "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
            "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 262144, "rope_theta": 5e6,
            "mrope_section": [24, 20, 20], "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        },
        "vision": {
            "depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16, "patch_size": 16,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [5, 11, 17],
        },
    },
    "8b": {  # Qwen3-VL-8B-Instruct's config.json (hub), the backbone of Qwen3-VL-Reranker-8B
        "text": {
            "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 262144, "rope_theta": 5e6,
            "mrope_section": [24, 20, 20], "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        },
        "vision": {  # = transformers' Qwen3VLVisionConfig defaults
            "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "patch_size": 16,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [8, 16, 24],
        },
    },
    "tiny": {  # builtin:tiny-qwen3-vl: DeepStack into the first two of three decoder layers, interleaved mRoPE
        "text": {
            # head_dim 64 (wider than hidden / heads, as Qwen3 allows): Qwen3 normalises q and k per head (QK-norm),
            # which caps an attention logit at sqrt(head_dim) until the norms' weights grow. At head_dim 16 (cap 4)
            # the smoke run stayed at the base-rate loss for 300 steps at learning rates 4e-3 and 1e-2 (MRR@10
            # 0.52 -> 0.53 and 0.52); the published models have head_dim 128 (cap 11.3)
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 16384, "rope_theta": 5e6,
            # head_dim / 2 = 32 frequencies, split (temporal, height, width) and interleaved as [24, 20, 20] / 2
            "mrope_section": [12, 10, 10], "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        },
        "vision": {
            "depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 16,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 256,
            "deepstack_visual_indexes": [0, 1],
        },
    },
}


def architecture_config(size: str, vocab_size: int | None = None, token_ids: dict[str, int] | None = None):
    """``Qwen3VLConfig`` of ``size`` (``"2b"``, ``"8b"`` or ``"tiny"``), for random initialisation.

    ``vocab_size`` and ``token_ids`` (keys of Qwen2.5-VL's ``TOKEN_IDS``, the same ids in Qwen3-VL) default to the
    published model's; ``builtin:tiny-qwen3-vl`` passes its own tokenizer's.
    """
    from transformers import Qwen3VLConfig

    if size not in ARCHITECTURES:
        raise ValueError(f"unknown Qwen3-VL size {size!r}; known: {', '.join(ARCHITECTURES)}")
    unknown = sorted(set(token_ids or {}) - set(TOKEN_IDS))
    if unknown:
        raise ValueError(f"unknown token ids {unknown}; known: {sorted(TOKEN_IDS)}")
    ids = {**TOKEN_IDS, **(token_ids or {})}
    t, v = dict(ARCHITECTURES[size]["text"]), ARCHITECTURES[size]["vision"]
    tie = t.pop("tie_word_embeddings")
    rope = {"rope_type": "default", "rope_theta": t.pop("rope_theta"), "mrope_section": list(t.pop("mrope_section")),
            "mrope_interleaved": True}
    special = {"bos_token_id": ids["pad_token_id"], "eos_token_id": ids["eos_token_id"],
               "pad_token_id": ids["pad_token_id"]}
    return Qwen3VLConfig(
        text_config={"vocab_size": vocab_size or VOCAB_SIZE, **t, "rope_parameters": rope, **special,
                     "tie_word_embeddings": tie},
        vision_config={**v, "out_hidden_size": t["hidden_size"],
                       "deepstack_visual_indexes": list(v["deepstack_visual_indexes"])},
        image_token_id=ids["image_token_id"],
        video_token_id=ids["video_token_id"],
        vision_start_token_id=ids["vision_start_token_id"],
        vision_end_token_id=ids["vision_end_token_id"],
        tie_word_embeddings=tie,
    )


# Qwen3-VL-Instruct's template has no default system message (Qwen2.5-VL adds "You are a helpful assistant.")
CHAT_TEMPLATE = qwen_vl_chat_template(None)

# Qwen3-VL-Reranker's pixel budget: 4 to 1,800 visual tokens of 32 x 32 pixels
MIN_PIXELS = 4 * 32 * 32
MAX_PIXELS = 1800 * 32 * 32

TINY_RECIPE: dict[str, Any] = {
    "family": "qwen3_vl",
    "bpe_vocab_size": 1200,
    "text": ARCHITECTURES["tiny"]["text"],
    "vision": ARCHITECTURES["tiny"]["vision"],
    "image": {"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS, "mean": IMAGE_MEAN, "std": IMAGE_STD},
    "chat_template": CHAT_TEMPLATE,
    "special_tokens": SPECIAL_TOKENS,
}


def build_tiny(out: Path, corpus: list[str], seed: int) -> None:
    """Save the tiny Qwen3-VL (random weights from ``seed``, fp32, safetensors) and its processor into ``out``."""
    from .prompt import DEFAULT_INSTRUCTION, EMPTY_SIDE

    tok = build_tiny_tokenizer(corpus + [DEFAULT_INSTRUCTION, EMPTY_SIDE] * 8)  # this family's prompt pieces too
    tok.chat_template = CHAT_TEMPLATE
    padded_vocab = (len(tok) + 63) // 64 * 64
    config = architecture_config("tiny", padded_vocab, token_ids_of(tok))
    torch.manual_seed(seed)
    model = model_class()(config).to(torch.float32).eval()
    model.save_pretrained(out)

    v = TINY_RECIPE["vision"]
    image_processor = image_processor_class()(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        patch_size=v["patch_size"],
        temporal_patch_size=v["temporal_patch_size"],
        merge_size=v["spatial_merge_size"],
        image_mean=IMAGE_MEAN,
        image_std=IMAGE_STD,
    )
    processor = processor_shim_class()(image_processor=image_processor, tokenizer=tok, chat_template=CHAT_TEMPLATE)
    save_processor(processor, out)


__all__ = ["ARCHITECTURES", "TINY_RECIPE", "architecture_config", "build_tiny", "TOKENS", "MIN_PIXELS", "MAX_PIXELS"]
