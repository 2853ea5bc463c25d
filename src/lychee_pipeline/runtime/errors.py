"""Refusals of the user's input, in one line: parameter errors (settings validated into their typed objects, a
bad key named in one line, with the closest known key), unreadable data and missing inputs.

Refusals of the user's input: one line on the terminal, the traceback in the log file.

`UserInputError` is the one base class for "the input is refused": a parameter, data the run was pointed at, or
a model source it cannot find. Its message is the whole story, in one line naming what to change. When a
`kedro run` ends with one (raised directly, or as the cause of another exception), `install_refusal_report`'s
exception hook prints that line last on the terminal and writes the traceback to the log files (`info.log`)
only; `LYCHEE_VERBOSE=1` prints the traceback on the terminal as before. Any other exception is a bug and keeps
its traceback on the terminal.

Each subclass is also the built-in exception callers already catch (a bad parameter is a ValueError, a missing
input a FileNotFoundError), so raising one changes what the user sees, never what a caller's `except` takes.
"""

from __future__ import annotations

import difflib
import logging
import os
import sys
from types import TracebackType
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError


VERBOSE_ENV = "LYCHEE_VERBOSE"


class UserInputError(Exception):
    """The user's input is refused (parameters, data, model source); the message is the one line to show."""


class InvalidParameter(UserInputError, ValueError):
    """A parameter value the run cannot use (`invalid parameter training.learning_rate: ...`)."""


class UnreadableData(UserInputError, ValueError):
    """Input data that cannot be read (a gzip file cut short, a corrupt stream)."""


class MissingInput(UserInputError, FileNotFoundError):
    """Input the run was pointed at and did not find (no JSON lines files, no such model)."""


def refusal_in(error: BaseException | None) -> UserInputError | None:
    """The UserInputError that `error` is or was raised from (its __cause__ / __context__ chain), else None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, UserInputError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _log_files() -> list[logging.FileHandler]:
    return [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]


def report_refusal(refused: UserInputError, exc_info: tuple, stream=None) -> None:
    """The traceback into the log files, then the refusal's line on `stream` (stderr)."""
    stream = stream or sys.stderr
    files = _log_files()
    record = logging.LogRecord("lychee_pipeline.errors", logging.ERROR, __file__, 0, "refused: %s", (refused,),
                               exc_info)
    for handler in files:
        try:
            handler.handle(record)
        except Exception:  # noqa: BLE001 - the terminal line below is what matters
            pass
    where = " and ".join(os.path.relpath(h.baseFilename) for h in files)
    hint = f"the traceback is in {where}; " if where else ""
    message = " ".join(str(refused).split("\n")) or type(refused).__name__
    stream.write(f"({hint}{VERBOSE_ENV}=1 prints it here)\nError: {message}\n")
    stream.flush()


def install_refusal_report() -> None:
    """Make the process's last word on a refused input one line (`report_refusal`); other errors unchanged.

    Wraps the exception hook in place now (Rich's, installed by Kedro's log handler), so it is called after
    Kedro configured its logging. Idempotent.
    """
    previous = sys.excepthook
    if getattr(previous, "_reports_refusals", False):
        return

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        refused = refusal_in(exc)
        if refused is None or verbose():
            previous(exc_type, exc, tb)
            return
        report_refusal(refused, (exc_type, exc, tb))

    hook._reports_refusals = True  # type: ignore[attr-defined]
    sys.excepthook = hook


class ParameterError(ValidationError, UserInputError):
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
class UnknownParameterError(UserInputError, ValueError):
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
