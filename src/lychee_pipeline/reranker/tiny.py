"""``builtin:tiny``: a tiny random-weight Qwen2.5-VL reranker built offline and deterministically.

No model hub is reachable in development or CI, so this module builds a miniature of
Qwen2.5-VL-7B-Instruct with the same classes, the same special tokens, the same chat template
layout and the same image processing, and saves it with ``save_pretrained`` (safetensors) into a
cache folder. :func:`lychee_pipeline.reranker.model.load_reranker` then loads that folder through
exactly the code path it uses for a real checkpoint.

The folder carries a marker (``lychee_tiny.json``) holding the recipe version and a hash of the
recipe; it is rebuilt only when that changes. Builds go to a temporary sibling folder first and are
moved into place atomically, so concurrent processes (e.g. DDP ranks) never see half a model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

TINY_NAME = "builtin:tiny"
TINY_RECIPE_VERSION = 3
TINY_SEED = 1234
DEFAULT_TINY_DIR = Path("data/06_models/builtin_tiny")
TINY_DIR_ENV = "LYCHEE_TINY_DIR"
MARKER_FILE = "lychee_tiny.json"

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

# Everything that determines the built folder; its hash is stored in the marker.
RECIPE: dict[str, Any] = {
    "version": TINY_RECIPE_VERSION,
    "seed": TINY_SEED,
    "bpe_vocab_size": 1200,
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
    "image": {"min_pixels": 4 * 28 * 28, "max_pixels": 1280 * 28 * 28},
    "chat_template": CHAT_TEMPLATE,
}


def recipe_hash() -> str:
    return hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode()).hexdigest()[:16]


def tiny_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where ``builtin:tiny`` lives: ``cache_dir``, else ``$LYCHEE_TINY_DIR``, else data/06_models/builtin_tiny."""
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get(TINY_DIR_ENV) or DEFAULT_TINY_DIR)


def _corpus() -> list[str]:
    """Training text for the tiny BPE: prompt pieces, answers, English and Chinese shop text."""
    from .prompt import DEFAULT_INSTRUCTIONS, SYSTEM_PROMPT

    lines = [SYSTEM_PROMPT, "You are a helpful assistant.", "system", "user", "assistant"]
    lines += list(DEFAULT_INSTRUCTIONS.values())
    lines += ["<Instruct>:", "<Query>:", "\n<Document>:", "Picture 1:", "Video 1:"]
    # the answers, as whole words at the start of a line (how they follow "assistant\n")
    lines += ["yes", "no", "Yes", "No"] * 50
    english = [
        "red running shoes for women with a breathable mesh upper",
        "a stainless steel water bottle that keeps drinks cold for a day",
        "wireless headphones with noise cancelling and long battery life",
        "a wooden desk lamp with a warm light and an adjustable arm",
        "cotton t-shirt in blue, size medium, machine washable",
        "leather wallet with six card slots and a coin pocket",
        "the quick brown fox jumps over the lazy dog",
        "what is the best phone case for a small budget",
        "find a picture of a black backpack with many pockets",
        "this product matches the query because it has the same colour and shape",
        "price 19.99 dollars, free shipping, 4.5 stars from 120 reviews",
        "Query Document Instruct image text relevant retrieve passage answer",
    ]
    chinese = [
        "红色女士跑步鞋，透气网面",
        "不锈钢保温水杯，保冷一整天",
        "无线降噪耳机，续航时间长",
        "木质台灯，暖光，可调节灯臂",
        "蓝色纯棉T恤，中号，可机洗",
        "真皮钱包，六个卡位和一个零钱袋",
        "请找一张有很多口袋的黑色双肩包的图片",
        "这个商品和查询的颜色、形状都一样",
        "价格十九元九角，包邮，好评率很高",
        "查询 文档 指令 图片 文本 相关 检索 是 否",
    ]
    lines += english * 8 + chinese * 8 + [str(n) for n in range(200)]
    return lines


def _build_tokenizer():
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
        vocab_size=RECIPE["bpe_vocab_size"],
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    trainer_tok.train_from_iterator(_corpus(), trainer=trainer)
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


def _image_processor_class():
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


def _build(out: Path) -> None:
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from .model import LycheeProcessor, save_processor

    tok = _build_tokenizer()
    vocab_size = len(tok)
    padded_vocab = (vocab_size + 63) // 64 * 64
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    t, v = RECIPE["text"], RECIPE["vision"]
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": padded_vocab,
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
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
            "tie_word_embeddings": False,
        },
        vision_config={
            "depth": v["depth"],
            "hidden_size": v["hidden_size"],
            "intermediate_size": v["intermediate_size"],
            "num_heads": v["num_heads"],
            "out_hidden_size": t["hidden_size"],
            "patch_size": v["patch_size"],
            "spatial_merge_size": v["spatial_merge_size"],
            "temporal_patch_size": v["temporal_patch_size"],
            "window_size": v["window_size"],
            "fullatt_block_indexes": list(v["fullatt_block_indexes"]),
        },
        # token ids are top-level fields and must match the tokenizer
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(TINY_SEED)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).eval()
    model.save_pretrained(out)

    img_cls = _image_processor_class()
    image_processor = img_cls(
        size={"shortest_edge": RECIPE["image"]["min_pixels"], "longest_edge": RECIPE["image"]["max_pixels"]},
        patch_size=v["patch_size"],
        temporal_patch_size=v["temporal_patch_size"],
        merge_size=v["spatial_merge_size"],
    )
    processor = LycheeProcessor(image_processor=image_processor, tokenizer=tok, chat_template=CHAT_TEMPLATE)
    save_processor(processor, out)
    (out / MARKER_FILE).write_text(
        json.dumps({"name": TINY_NAME, "recipe_version": TINY_RECIPE_VERSION, "recipe_hash": recipe_hash()}, indent=2)
    )


def is_current(folder: Path) -> bool:
    marker = folder / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return data.get("recipe_version") == TINY_RECIPE_VERSION and data.get("recipe_hash") == recipe_hash()


def ensure_tiny(cache_dir: str | os.PathLike | None = None) -> Path:
    """Build ``builtin:tiny`` into its cache folder if missing or stale; return the folder."""
    folder = tiny_dir(cache_dir).resolve()
    if is_current(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.build-", dir=folder.parent))
    try:
        _build(tmp)
        if folder.exists() and not is_current(folder):
            stale = folder.with_name(f".{folder.name}.stale-{os.getpid()}")
            try:
                os.replace(folder, stale)
                shutil.rmtree(stale, ignore_errors=True)
            except OSError:
                pass
        try:
            os.replace(tmp, folder)
        except OSError:
            if not is_current(folder):  # someone else won the race with a good build: keep theirs
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder
