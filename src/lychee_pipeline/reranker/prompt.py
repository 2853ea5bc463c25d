"""The Lychee-rerank-mm prompt: system message, per-task instructions and the user message layout.

The model scores a (query, document) pair by the probability of answering ``yes`` after this
conversation, so the layout below must stay exactly as the published model was trained with:

system: SYSTEM_PROMPT
user:   "<Instruct>: {instruction}" "<Query>:" [query image] [query text]
        "\\n<Document>:" [document image] [document text]

The parts are concatenated by the chat template without separators, and the generation prompt
(``<|im_start|>assistant\\n``) is appended, so the scored position is the last token.

Items are plain dicts ``{"text": str | None, "image": str | PIL.Image.Image | None}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SYSTEM_PROMPT = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided. "
    'Note that the answer can only be "yes" or "no".'
)

#: Default instruction per task type ``"<q>2<d>"`` (q, d in t, i, it); ``"default"`` is the fallback.
DEFAULT_INSTRUCTIONS: dict[str, str] = {
    "t2t": "Given a web search query, retrieve relevant passages that answer the query",
    "t2i": "Given a text query, retrieve the image that best matches the query",
    "i2t": "Given an image, retrieve the text passage that best describes the image",
    "i2i": "Given an image, retrieve images that show the same or a closely related item",
    "it2it": "Given a query made of an image and text, retrieve the document with image and text that best satisfies it",
    "default": "Given a query, retrieve the documents that are relevant to the query",
}

Item = Mapping[str, Any]


def _text(item: Item) -> str | None:
    text = item.get("text")
    if text is None:
        return None
    if not isinstance(text, str):
        raise TypeError(f"item text must be a string or None, got {type(text).__name__}")
    return text if text != "" else None


def _image(item: Item) -> Any:
    image = item.get("image")
    if image is None or (isinstance(image, str) and image == ""):
        return None
    return image


def modality_of(item: Item) -> str:
    """``"t"`` (text only), ``"i"`` (image only) or ``"it"`` (image and text)."""
    if not isinstance(item, Mapping):
        raise TypeError(f"an item must be a dict with 'text' and/or 'image', got {type(item).__name__}")
    has_text, has_image = _text(item) is not None, _image(item) is not None
    if has_text and has_image:
        return "it"
    if has_image:
        return "i"
    if has_text:
        return "t"
    raise ValueError(f"an item needs a non-empty 'text' or an 'image': {dict(item)!r}")


def task_type_or_default(query: Item, doc: Item) -> str:
    """:func:`task_type_of`, or ``"default"`` where a side is empty (a family whose prompt writes ``NULL`` for an
    empty side takes such a pair; the others refuse it when building its messages)."""
    try:
        return task_type_of(query, doc)
    except ValueError:
        return "default"


def task_type_of(query: Item, doc: Item) -> str:
    """Task type ``"<q>2<d>"``, for example ``"t2i"`` for a text query and an image document."""
    return f"{modality_of(query)}2{modality_of(doc)}"


def instruction_for(task_type: str, instructions: Mapping[str, str] | None = None,
                    defaults: Mapping[str, str] | None = None) -> str:
    """The instruction for ``task_type``: from ``instructions`` (if given), else the defaults.

    ``instructions`` may hold only some task types and/or a ``"default"`` key; missing ones fall back
    to ``defaults`` (a model family's ``DEFAULT_INSTRUCTIONS``; Lychee-rerank-mm's :data:`DEFAULT_INSTRUCTIONS`
    when None).
    """
    table = dict(DEFAULT_INSTRUCTIONS if defaults is None else defaults)
    if instructions:
        table.update(instructions)
    return table.get(task_type, table["default"])


def build_messages(query: Item, doc: Item, instruction: str | None = None) -> list[dict[str, Any]]:
    """Chat messages for one pair, in the exact Lychee-rerank-mm order.

    ``instruction=None`` picks the default instruction of the pair's task type. Images are kept as
    given (a path or a PIL image); the collator loads them.
    """
    if instruction is None:
        instruction = instruction_for(task_type_of(query, doc))
    else:
        task_type_of(query, doc)  # validates both items
    content: list[dict[str, Any]] = [
        {"type": "text", "text": f"<Instruct>: {instruction}"},
        {"type": "text", "text": "<Query>:"},
    ]
    for prefix, item in ((None, query), ("\n<Document>:", doc)):
        if prefix is not None:
            content.append({"type": "text", "text": prefix})
        image, text = _image(item), _text(item)
        if image is not None:
            content.append({"type": "image", "image": image})
        if text is not None:
            content.append({"type": "text", "text": text})
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": content},
    ]


def render_prompt(processor: Any, messages: list[dict[str, Any]]) -> str:
    """Prompt text through the processor's chat template, generation prompt added (one image
    placeholder per image; the processor expands it)."""
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
