"""Refusals of the user's input: one line on the terminal, the traceback in the log file.

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

import logging
import os
import sys
from types import TracebackType

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
