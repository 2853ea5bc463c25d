"""One-line parameter errors: settings validated into their typed objects, a bad key named in one line."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError


class ParameterError(ValidationError):
    """A bad parameter, in one line naming it (`invalid parameter training.learning_rate: ...`).

    A pydantic ValidationError (and so a ValueError) whose message is one line instead of pydantic's block.
    """

    def __str__(self) -> str:
        return "; ".join(
            "invalid parameter " + ".".join([self.title, *map(str, e["loc"])]) + f": {e['msg']}"
            + (f" (got {e['input']!r})" if not isinstance(e.get("input"), dict) else "")
            for e in self.errors(include_url=False)
        )


def validated(cls: type, section: str, values: Any) -> Any:
    """`values` as `cls` (a pydantic model or a dataclass), or a ParameterError naming the bad key."""
    if isinstance(cls, type) and isinstance(values, cls):  # already typed (passed between nodes)
        return values
    try:
        return TypeAdapter(cls).validate_python(values)
    except ValidationError as error:
        errors = [{k: v for k, v in e.items() if k in {"type", "loc", "input", "ctx"}} for e in error.errors()]
        for e in errors:  # value errors carry the exception object; keep its message only
            if "ctx" in e:
                e["ctx"] = {k: str(v) for k, v in e["ctx"].items()}
        raise ParameterError.from_exception_data(section, errors) from None


# A mistyped key: `typed(cls, "data_processing.split", values)` is `validated` plus, for a key the model does not
# know, the closest key it does know (``--params data_processing.split.sed=7`` -> ``...; did you mean
# data_processing.split.seed?``).
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
