"""Typed parameter blocks with a hint for a mistyped key (Kedro-free).

`typed(cls, "data_processing.split", values)` is the planner's one-line `validated`, plus, for a key the
model does not know, the closest key it does know (``--params data_processing.split.sed=7`` ->
``...; did you mean data_processing.split.seed?``). The hint belongs beside `validated` (the runtime's
parameter errors); it lives here until both are in one place.
"""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel

from lychee_pipeline.training.planning import ParameterError, validated


class UnknownParameterError(ValueError):
    """A parameter key no typed block has, in one line with the closest known key."""


def _fields_at(cls: type, path: tuple) -> list[str]:
    """The field names of the (nested) model at ``path`` inside ``cls``; [] where it is no model."""
    for name in path:
        field = cls.model_fields.get(str(name)) if isinstance(cls, type) and issubclass(cls, BaseModel) else None
        if field is None:
            return []
        cls = field.annotation
    return list(cls.model_fields) if isinstance(cls, type) and issubclass(cls, BaseModel) else []


def closest_keys(cls: type, section: str, error: ParameterError) -> list[str]:
    """`section.key` suggestions for each unknown key of ``error`` (close matches among the known keys)."""
    hints = []
    for e in error.errors(include_url=False):
        if e["type"] != "extra_forbidden":
            continue
        *parent, key = map(str, e["loc"])
        for match in difflib.get_close_matches(key, _fields_at(cls, tuple(parent)), n=1, cutoff=0.6):
            hints.append(".".join([section, *parent, match]))
    return hints


def typed(cls: type, section: str, values: Any) -> Any:
    """``values`` as ``cls`` (as they are when already typed), or a one-line error naming the bad key."""
    if isinstance(values, cls):
        return values
    try:
        return validated(cls, section, dict(values or {}))
    except ParameterError as error:
        hints = closest_keys(cls, section, error)
        if not hints:
            raise
        raise UnknownParameterError(f"{error}; did you mean {' or '.join(hints)}?") from None
