"""The launcher's view of a stage's progress, from the ranks' heartbeat files (runtime/heartbeat.py).

`StageProgress.update(beats)` takes the ranks' last heartbeat records (the launcher reads them once a second for
its watchdog) and shows, per stage (and per task within a stage: the model a scoring launch scores):

- on a terminal, one bar (rich): steps done / total, percent, rate, elapsed time, time left, last loss;
- otherwise (a log file, CI), a plain log line when another tenth of the work is done or 30 s have passed,
  whichever comes first, and one at the end: a few lines per stage, never one per step.

The spacing of the plain lines: environment variables `LYCHEE_PROGRESS_EVERY_PERCENT` (default 10) and
`LYCHEE_PROGRESS_EVERY_S` (default 30). `LYCHEE_PROGRESS=lines` gives plain lines on a terminal too, `off` none.

A training stage's progress is its slowest rank's step (every rank takes every optimizer step); a scoring
launch's is the sum of its shards (each rank scores its own share of the pairs).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_EVERY_PERCENT = 10.0
PAST_THE_WORK = ("leaving", "done")  # heartbeat phases after the final barrier
DEFAULT_EVERY_S = 30.0


def _env_float(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, default))
    except ValueError:
        log.warning("%s=%r is not a number; using %s", name, os.environ[name], default)
        return default
    return value if value > 0 else default


def on_a_terminal() -> bool:
    """Where a bar can be drawn: rich's console (the one Kedro's log handler writes to) is a terminal."""
    try:
        from rich import get_console
    except ImportError:
        return False
    return get_console().is_terminal and sys.stderr.isatty()


@dataclass
class TaskProgress:
    """Progress of one task: what the ranks' records say, and what the plain lines have said."""

    label: str
    unit: str
    total: int | None = None
    done: int = 0
    first_done: int = 0  # at the first look: the rate counts from here (a resumed stage starts past 0)
    first_seen: float = field(default_factory=time.monotonic)
    last_line_done: int | None = None
    last_line_at: float = 0.0
    bar_id: Any = None

    def rate(self, now: float) -> float | None:
        elapsed = now - self.first_seen
        return (self.done - self.first_done) / elapsed if elapsed > 0 and self.done > self.first_done else None


def summarize(beats: dict[int, dict]) -> dict[str | None, tuple[int, int | None, str]]:
    """{task: (done, total, unit)} of the ranks' records: the slowest rank's step, or the shards' sum."""
    tasks: dict[str | None, list[dict]] = {}
    for record in beats.values():
        if record.get("total") is None:
            continue  # this rank has not begun its work yet
        tasks.setdefault(record.get("task"), []).append(record)
    summary = {}
    for task, records in tasks.items():
        total = max(int(r["total"]) for r in records)
        if any(r.get("sharded") for r in records):
            done = sum(int(r["step"]) for r in records)
        else:
            done = min(int(r["step"]) for r in records)
        summary[task] = (min(done, total), total, str(records[0].get("unit") or "step"))
    return summary


class StageProgress:
    """Shows one stage's progress; `update()` as often as convenient, `close()` always (a `finally`)."""

    def __init__(self, stage: str, terminal: bool | None = None, every_percent: float | None = None,
                 every_s: float | None = None, started_at: float | None = None):
        """``started_at``: the ``time.monotonic()`` at which the work began from 0 done (work counted in this
        process): the rate counts from there. None (a stage's ranks, a resumed stage that starts past 0): from
        the first look at the ranks' records."""
        mode = os.environ.get("LYCHEE_PROGRESS", "auto")
        self.stage = stage
        self.started_at = started_at
        self.enabled = mode != "off"
        self.terminal = (on_a_terminal() if terminal is None else terminal) and mode != "lines"
        self.every_percent = every_percent or _env_float("LYCHEE_PROGRESS_EVERY_PERCENT", DEFAULT_EVERY_PERCENT)
        self.every_s = every_s or _env_float("LYCHEE_PROGRESS_EVERY_S", DEFAULT_EVERY_S)
        self.tasks: dict[str | None, TaskProgress] = {}
        self.loss: float | None = None  # the last loss a rank logged (runtime/launcher.py reads it from the relayed lines)
        self._bars = None
        self.closed = False

    def _label(self, task: str | None) -> str:
        return self.stage if task is None else f"{self.stage} {task}"

    def note_loss(self, loss: float) -> None:
        self.loss = loss

    def update(self, beats: dict[int, dict]) -> None:
        if not self.enabled or self.closed:
            return
        now = time.monotonic()
        summary = summarize(beats)
        for task, (done, total, unit) in summary.items():
            if task not in self.tasks:
                first_done, first_seen = (done, now) if self.started_at is None else (0, self.started_at)
                self.tasks[task] = TaskProgress(self._label(task), unit, total, done, first_done, first_seen)
            # never backwards: a scoring rank's last records (past its work) say step 0
            self.tasks[task].done, self.tasks[task].total = max(self.tasks[task].done, done), total
        # The ranks take their tasks one after another, between barriers: a task that a newer one followed is
        # complete, and so is every task once all ranks are past the final barrier (their last slices may
        # have come and gone between two looks).
        past_barrier = bool(beats) and all(r.get("phase") in PAST_THE_WORK for r in beats.values())
        newest = list(self.tasks)[-1] if self.tasks else None
        for task, progress in self.tasks.items():
            if progress.total is not None and (past_barrier or task != newest):
                progress.done = progress.total
            if task in summary or progress.done == progress.total:
                if self.terminal:
                    self._draw(progress)
                else:
                    self._maybe_line(progress, now)

    def close(self) -> None:
        """Stop the bars (a finished bar stays on screen); the plain lines say where each task ended."""
        if self.closed:
            return
        self.closed = True
        if self._bars is not None:
            self._bars.refresh()
            self._bars.stop()
            self._bars = None
        elif not self.terminal:
            now = time.monotonic()
            for progress in self.tasks.values():
                if progress.last_line_done != progress.done:
                    self._line(progress, now)

    # --- a terminal: rich bars ------------------------------------------------------------------------

    def _draw(self, progress: TaskProgress) -> None:
        if self._bars is None:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)

            self._bars = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[unit]}"),
                TaskProgressColumn(), TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("ETA"),
                TimeRemainingColumn(), TextColumn("{task.fields[loss]}"),
                refresh_per_second=2, transient=False,
            )
            self._bars.start()
        fields = {"unit": f"{progress.unit}s", "rate": self._rate_text(progress, time.monotonic()),
                  "loss": f"loss {self.loss:.4f}" if self.loss is not None else ""}
        if progress.bar_id is None:
            progress.bar_id = self._bars.add_task(progress.label, total=progress.total, completed=progress.done,
                                                  **fields)
        else:
            self._bars.update(progress.bar_id, total=progress.total, completed=progress.done, **fields)

    @staticmethod
    def _rate_text(progress: TaskProgress, now: float) -> str:
        rate = progress.rate(now)
        if rate is None:
            return ""
        return f"{rate:.1f} {progress.unit}s/s" if rate >= 1 else f"{1 / rate:.1f} s/{progress.unit}"

    # --- a file: a few plain lines --------------------------------------------------------------------

    def _maybe_line(self, progress: TaskProgress, now: float) -> None:
        if progress.total is None or progress.done == progress.last_line_done:
            return
        every = max(1, int(progress.total * self.every_percent / 100))
        if (progress.last_line_done is None or progress.done >= progress.total
                or progress.done - progress.last_line_done >= every or now - progress.last_line_at >= self.every_s):
            self._line(progress, now)

    def _line(self, progress: TaskProgress, now: float) -> None:
        progress.last_line_done, progress.last_line_at = progress.done, now
        total = progress.total or 0
        count = (f"{progress.unit} {progress.done}/{total}" if progress.unit == "step"  # step 3/6, 512/2128 pairs
                 else f"{progress.done}/{total} {progress.unit}s")
        parts = [f"{progress.label}: {count} ({100 * progress.done / max(1, total):.0f}%)"]
        rate = progress.rate(now)
        if rate is not None:
            parts.append(self._rate_text(progress, now))
            parts.append(f"ETA {(total - progress.done) / rate:.0f} s")
        if self.loss is not None and progress.unit == "step":
            parts.append(f"loss {self.loss:.4f}")
        log.info("%s", ", ".join(parts))


class CountedProgress:
    """Progress of work counted in this process (images checked, records mined): the same bar, or plain lines in
    a file, as a stage's, fed with counts instead of the ranks' records. ``update(n)`` adds n; use it as a
    context manager (or ``close()`` it in a ``finally``). ``enabled`` False shows nothing. The rate counts from
    the moment it is made (work handed out in chunks, all of a chunk's results arriving at once, would otherwise
    count from the first result seen)."""

    def __init__(self, label: str, total: int, unit: str, enabled: bool = True):
        self.view = StageProgress(label, started_at=time.monotonic()) if enabled and total else None
        self.done, self.total, self.unit = 0, total, unit
        self._shown_at = 0.0

    def _show(self) -> None:
        self.view.update({0: {"step": self.done, "total": self.total, "unit": self.unit}})

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        # at most twice a second: a bar redraws at that rate, and a file gets its lines by work done or by time
        if self.view is not None and (now - self._shown_at >= 0.5 or self.done >= self.total):
            self._shown_at = now
            self._show()

    def close(self) -> None:
        if self.view is not None:
            self._show()
            self.view.close()

    def __enter__(self) -> CountedProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()  # on an error too: a terminal's bar stops drawing
