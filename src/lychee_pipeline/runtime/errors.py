"""One-line parameter errors: settings validated into their typed objects, a bad key named in one line."""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter, ValidationError


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
