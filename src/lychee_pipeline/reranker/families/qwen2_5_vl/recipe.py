"""The Qwen2.5-VL recipe: the 7B and ``tiny`` configs from one table, and the tiny miniature built from it.

- :data:`ARCHITECTURES`: text and vision dimensions of the published 7B and of ``tiny`` (every code path of the
  7B at a size a CPU trains); :func:`architecture_config` makes the transformers config of either (the GPU
  benchmarks build both with it).
- The tiny recipe (:data:`TINY_RECIPE`): Qwen's special tokens and chat template layout, a byte-level BPE with
  Qwen2's pre-tokenization, random weights from a seed (:func:`build_tiny`; ``reranker/tiny.py`` caches the
  folder and hashes the recipe into its marker).

transformers is imported by the functions that use it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .model import model_class
from .processor import image_processor_class, processor_shim_class, save_processor

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



# -- the tiny recipe (builtin:tiny): Qwen's tokens and template on a miniature of the architecture

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

def qwen_vl_chat_template(default_system: str | None) -> str:
    """A chat template that renders text and image messages as Qwen-VL Instruct models do: image placeholders
    wrapped in vision start/end, the generation prompt, and ``default_system`` as the system message when the
    conversation has none (Qwen2.5-VL adds one, Qwen3-VL none)."""
    system = ("{% if loop.first and message['role'] != 'system' %}"
              f"<|im_start|>system\n{default_system}<|im_end|>\n"
              "{% endif %}") if default_system else ""
    return (
        "{% set ns = namespace(images=0, videos=0) %}"
        "{% for message in messages %}"
        f"{system}"
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


# Qwen2.5-VL-Instruct's template: the default system message is "You are a helpful assistant."
CHAT_TEMPLATE = qwen_vl_chat_template("You are a helpful assistant.")

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

