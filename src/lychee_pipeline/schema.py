"""Raw record models (pydantic) and the Arrow layout of the model-input row (see docs/architecture.md)."""

from __future__ import annotations

from typing import Any, Literal

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

SPLITS = ("train", "val", "test")

_STRICT = ConfigDict(extra="forbid", strict=True)

#: Invisible characters stripped with the whitespace around text: a text of only these is empty.
ZERO_WIDTH = "\u200b\u200c\u200d\u2060\ufeff"


def strip_invisible(value: str) -> str:
    """Strip whitespace and zero-width characters (U+200B, U+200C, U+200D, U+2060, U+FEFF) at both ends."""
    previous = None
    while previous != value:
        previous, value = value, value.strip().strip(ZERO_WIDTH)
    return value


def blank(value: str | None) -> bool:
    """Whether a text is missing, or only whitespace and zero-width characters."""
    return not value or not strip_invisible(value)


class RawItem(BaseModel):
    """A query given as an object: text, image path, or both."""

    model_config = _STRICT
    text: str | None = None
    image: str | None = None


class RawDoc(BaseModel):
    """A document of a raw record: text and/or image, with an optional id and business meta."""

    model_config = _STRICT
    id: str | None = None
    text: str | None = None
    image: str | None = None
    meta: dict[str, Any] | None = None
    hard: bool | None = None


class RawRecord(BaseModel):
    """One raw JSONL line: a query, one or more positives, optional negatives, optional id and pinned split."""

    model_config = _STRICT
    id: str | None = None
    query: str | RawItem
    pos_doc: RawDoc | None = None
    pos_docs: list[RawDoc] | None = None
    neg_docs: list[RawDoc] | None = None
    split: Literal["train", "val", "test"] | None = None

    @field_validator("query")
    @classmethod
    def _query_not_empty(cls, value: str | RawItem) -> str | RawItem:
        if isinstance(value, str):
            if blank(value):
                raise ValueError("empty query")
        elif blank(value.text) and not (value.image or "").strip():
            raise ValueError("empty query")
        return value

    @model_validator(mode="after")
    def _has_positive_and_content(self) -> RawRecord:
        positives = ([self.pos_doc] if self.pos_doc is not None else []) + list(self.pos_docs or [])
        if not positives:
            raise ValueError("no positive")
        for kind, docs in (("positive", positives), ("negative", self.neg_docs or [])):
            for i, doc in enumerate(docs):
                if blank(doc.text) and not (doc.image or "").strip():
                    raise ValueError(f"empty document ({kind} {i} has neither text nor image)")
        return self


ITEM_TYPE = pa.struct([("text", pa.string()), ("image", pa.string())])
POSITIVE_TYPE = pa.struct(
    [("doc_id", pa.string()), ("text", pa.string()), ("image", pa.string()), ("meta", pa.string())]
)
NEGATIVE_TYPE = pa.struct(
    [
        ("doc_id", pa.string()),
        ("text", pa.string()),
        ("image", pa.string()),
        ("hard", pa.bool_()),
        ("meta", pa.string()),
    ]
)

#: The model-input row of the contract; also the shape of ingested and normalized records.
MODEL_INPUT_SCHEMA = pa.schema(
    [
        pa.field("record_id", pa.string(), nullable=False),
        pa.field("query", ITEM_TYPE),
        pa.field("positives", pa.list_(POSITIVE_TYPE)),
        pa.field("negatives", pa.list_(NEGATIVE_TYPE)),
        pa.field("task_type", pa.string()),
        pa.field("language", pa.string()),
        pa.field("split", pa.string()),
    ]
)

#: Quarantined records: the row plus why it was set aside.
QUARANTINE_SCHEMA = MODEL_INPUT_SCHEMA.append(pa.field("reason", pa.string()))

#: Image manifest: one row per unique resolved image file.
MANIFEST_SCHEMA = pa.schema(
    [
        pa.field("path", pa.string(), nullable=False),
        pa.field("ok", pa.bool_()),
        pa.field("reason", pa.string()),
        pa.field("width", pa.int32()),
        pa.field("height", pa.int32()),
        pa.field("format", pa.string()),
        pa.field("mode", pa.string()),
        pa.field("frames", pa.int32()),
        pa.field("orientation", pa.int8()),  # EXIF orientation (1 = upright); width/height are as stored
        pa.field("size_bytes", pa.int64()),
        pa.field("mtime_ns", pa.int64()),
        pa.field("max_pixels", pa.int64()),
    ]
)

#: Negatives removed during normalization, with the reason.
REMOVED_NEGATIVE_SCHEMA = pa.schema(
    [
        pa.field("record_id", pa.string()),
        pa.field("doc_id", pa.string()),
        pa.field("image", pa.string()),
        pa.field("reason", pa.string()),
    ]
)


def empty_table(schema: pa.Schema) -> pa.Table:
    """An empty table of ``schema``."""
    return schema.empty_table()
