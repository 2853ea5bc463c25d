"""The Qwen3-VL-Reranker prompt, laid out as its authors' inference code lays it out
(``src/models/qwen3_vl_reranker.py`` of QwenLM/Qwen3-VL-Embedding; see docs/architecture.md):

system: SYSTEM_PROMPT (the same sentence as Lychee-rerank-mm's)
user:   "<Instruct>: {instruction}" "<Query>:" [query image] [query text]
        "\\n<Document>:" [document image] [document text]

with ``NULL`` as the text of a side that has neither image nor text, images before text within a side, and the
chat template's generation prompt added (the scored position is the last token). One default instruction for
every task type (the model is instruction-aware: per-task instructions may still be given).
"""

from __future__ import annotations

from typing import Any

from ...prompt import SYSTEM_PROMPT, Item, _image, _text

DEFAULT_INSTRUCTION = "Given a search query, retrieve relevant candidates that answer the query."
DEFAULT_INSTRUCTIONS: dict[str, str] = {"default": DEFAULT_INSTRUCTION}
EMPTY_SIDE = "NULL"


def side_content(item: Item | None) -> list[dict[str, Any]]:
    """One side's content parts: its image, then its text; ``NULL`` where it has neither."""
    parts: list[dict[str, Any]] = []
    image = _image(item) if item else None
    text = _text(item) if item else None
    if image is not None:
        parts.append({"type": "image", "image": image})
    if text is not None:
        parts.append({"type": "text", "text": text})
    return parts or [{"type": "text", "text": EMPTY_SIDE}]


def build_messages(query: Item | None, doc: Item | None, instruction: str | None = None) -> list[dict[str, Any]]:
    """Chat messages for one pair in the Qwen3-VL-Reranker layout (an empty side becomes ``NULL``)."""
    content: list[dict[str, Any]] = [
        {"type": "text", "text": f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}"},
        {"type": "text", "text": "<Query>:"},
        *side_content(query),
        {"type": "text", "text": "\n<Document>:"},
        *side_content(doc),
    ]
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": content}]
