"""The Lychee prompt: message layout, task types, and a golden rendering of one pair per task type."""

import json
from pathlib import Path

import pytest

from lychee_pipeline.reranker import DEFAULT_INSTRUCTIONS, SYSTEM_PROMPT, build_messages, task_type_of
from lychee_pipeline.reranker.families.qwen2_5_vl import load_processor
from lychee_pipeline.reranker.prompt import instruction_for, render_prompt

Q_IMG, D_IMG = "/data/query.png", "/data/doc.png"
GOLDEN_PAIRS = {
    "t2t": ({"text": "red shoes", "image": None}, {"text": "Red running shoes.", "image": None}),
    "t2i": ({"text": "a red shoe", "image": None}, {"text": None, "image": D_IMG}),
    "i2t": ({"text": None, "image": Q_IMG}, {"text": "A red shoe.", "image": None}),
    "i2i": ({"text": None, "image": Q_IMG}, {"text": None, "image": D_IMG}),
    "it2it": ({"text": "same shoe in blue", "image": Q_IMG}, {"text": "Blue shoe", "image": D_IMG}),
}

_HEAD = (
    "<|im_start|>system\n"
    'Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
    'Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
_TAIL = "<|im_end|>\n<|im_start|>assistant\n"
_IMG = "<|vision_start|><|image_pad|><|vision_end|>"
GOLDEN_TEXT = {
    "t2t": _HEAD
    + "<Instruct>: Given a web search query, retrieve relevant passages that answer the query"
    + "<Query>:red shoes\n<Document>:Red running shoes."
    + _TAIL,
    "t2i": _HEAD
    + "<Instruct>: Given a text query, retrieve the image that best matches the query"
    + "<Query>:a red shoe\n<Document>:"
    + _IMG
    + _TAIL,
    "i2t": _HEAD
    + "<Instruct>: Given an image, retrieve the text passage that best describes the image"
    + "<Query>:"
    + _IMG
    + "\n<Document>:A red shoe."
    + _TAIL,
    "i2i": _HEAD
    + "<Instruct>: Given an image, retrieve images that show the same or a closely related item"
    + "<Query>:"
    + _IMG
    + "\n<Document>:"
    + _IMG
    + _TAIL,
    "it2it": _HEAD
    + "<Instruct>: Given a query made of an image and text, retrieve the document with image and text "
    + "that best satisfies it"
    + "<Query>:"
    + _IMG
    + "same shoe in blue\n<Document>:"
    + _IMG
    + "Blue shoe"
    + _TAIL,
}
GOLDEN_IDS_FILE = Path(__file__).with_name("golden_tiny_ids.json")


def test_system_prompt_is_lychee_s():
    assert SYSTEM_PROMPT == (
        "Judge whether the Document meets the requirements based on the Query and the Instruct provided. "
        'Note that the answer can only be "yes" or "no".'
    )


def test_message_order_for_image_and_text_on_both_sides():
    q = {"text": "query words", "image": Q_IMG}
    d = {"text": "doc words", "image": D_IMG}
    messages = build_messages(q, d, "Find it")
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[0]["content"] == SYSTEM_PROMPT
    assert messages[1]["content"] == [
        {"type": "text", "text": "<Instruct>: Find it"},
        {"type": "text", "text": "<Query>:"},
        {"type": "image", "image": Q_IMG},
        {"type": "text", "text": "query words"},
        {"type": "text", "text": "\n<Document>:"},
        {"type": "image", "image": D_IMG},
        {"type": "text", "text": "doc words"},
    ]


def test_task_types_and_instructions():
    t, i, it = {"text": "x"}, {"image": Q_IMG}, {"text": "x", "image": Q_IMG}
    assert [task_type_of(a, b) for a, b in [(t, t), (t, i), (i, t), (i, i), (it, it), (t, it)]] == [
        "t2t", "t2i", "i2t", "i2i", "it2it", "t2it",
    ]
    assert set(DEFAULT_INSTRUCTIONS) >= {"t2t", "t2i", "i2t", "i2i", "it2it", "default"}
    assert instruction_for("t2it") == DEFAULT_INSTRUCTIONS["default"]
    assert instruction_for("t2t", {"t2t": "custom"}) == "custom"
    assert instruction_for("i2i", {"t2t": "custom"}) == DEFAULT_INSTRUCTIONS["i2i"]
    with pytest.raises(ValueError, match="non-empty"):
        task_type_of({"text": "", "image": None}, t)


@pytest.mark.parametrize("task_type", list(GOLDEN_PAIRS))
def test_golden_rendering_and_tiny_token_ids(tiny_dir, task_type):
    processor = load_processor(tiny_dir)
    query, doc = GOLDEN_PAIRS[task_type]
    assert task_type_of(query, doc) == task_type
    text = render_prompt(processor, build_messages(query, doc))
    assert text == GOLDEN_TEXT[task_type]
    ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    golden = json.loads(GOLDEN_IDS_FILE.read_text())[task_type]
    assert ids == golden
    # special tokens are single ids and the answer tokens exist whole
    tok = processor.tokenizer
    for special in ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"):
        assert ids.count(tok.convert_tokens_to_ids(special)) == text.count(special)
