"""The scaling report: how throughput, cost and quality change with the number of devices.

Input: one ``StageResult`` (training/stage.py) per training stage, and each stage's test MRR@10 where it
was scored. Output: a ``ScalingReport`` of one ``ScalingRow`` per stage (both typed: the report is written as
JSON and read back through them).

Per stage:

* ``pairs_per_s``: training pairs processed per second, all devices together.
* ``scaling_efficiency = pairs_per_s(N) / (N * pairs_per_s(1))`` against the 1-device stage of the
  same device type. Without a 1-device stage the smallest device count ``M`` of that type is the
  reference: ``pairs_per_s(N) * M / (N * pairs_per_s(M))`` (the ``reference_devices`` field says so).
* ``epoch_time_s = full_train_pairs / pairs_per_s``: the projected time of one epoch over the full
  training set.
* ``device_hours_per_epoch = N * epoch_time_s / 3600`` (GPU-hours for CUDA stages), and
  ``relative_device_hours`` the same divided by the reference's (1 / efficiency).
* ``peak_mem_gib_max`` and the per-device list.

Comparability: a stage's ``pairs_per_s`` is timed over its steps after the first (``rate_steps``, from
``steps``). A rate that rests on few steps (a 10-step check stage) is dominated by warm-up and noise, so an
efficiency between it and a long final stage is not a scaling figure. When a row or its reference rests on
fewer than ``MIN_RATE_STEPS`` timed steps, or the two differ by more than ``MAX_RATE_STEPS_RATIO`` times,
``scaling_efficiency`` and ``relative_device_hours`` are ``None``, ``comparable`` is false and
``not_comparable`` says why (the raw ratio stays in ``raw_efficiency``).

Same window (like with like): when every stage of a device type has ``step_seconds`` ([step, seconds] of
each optimizer step, written by train.py), all of them are timed over the same steps: after
``WINDOW_WARMUP_STEPS`` warm-up steps, steps ``WINDOW_WARMUP_STEPS + 1`` to the last step every stage timed
(``window`` = [first, last], ``rate_steps`` = its length). ``pairs_per_s`` is then that window's rate
(pairs per step x steps / their seconds); the all-steps rate stays in ``pairs_per_s_all_steps``. A window
shorter than ``MIN_WINDOW_STEPS`` or a stage that did not time every step of it (a resumed stage) is marked
not comparable, with the reason.

The most cost-effective device count is the one with the fewest device-hours per epoch (ties go to
the faster, then to fewer devices).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:  # read by attribute only: the report module stays free of torch (training.stage imports it)
    from lychee_pipeline.training.stage import StageResult

MIN_RATE_STEPS = 20  # timed steps a rate must rest on before it is compared with another
MAX_RATE_STEPS_RATIO = 4.0
WINDOW_WARMUP_STEPS = 2  # steps left out of every stage's window (first-step compile, allocator warm-up)
MIN_WINDOW_STEPS = 5  # a common window shorter than this is not a scaling figure

# A stage's own training figures: logged on the parent run as scaling.<stage>.<field> and on the stage's nested
# run as scaling.<field> (report.stage_metric_name); its test figure (mrr_at_10) goes on the parent run only.
STAGE_RUN_FIELDS = ("devices", "wall_time_s", "pairs_per_s", "scaling_efficiency", "peak_mem_gib_max",
                    "epoch_time_s", "device_hours_per_epoch", "relative_device_hours")
PARENT_RUN_FIELDS = (*STAGE_RUN_FIELDS, "mrr_at_10")


class _Typed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ScalingRow(_Typed):
    """One stage's row of the scaling report (see the module text for each figure)."""

    stage: str
    devices: int
    device_type: Literal["cuda", "cpu"]
    label: str  # "4 GPUs", "2 CPU processes"
    wall_time_s: float
    train_pairs: int
    steps: int
    pairs_per_s: float | None  # over `window` when there is one, else over every step after the first
    pairs_per_s_all_steps: float | None = None  # the stage's own rate, when `pairs_per_s` is the window's
    pairs_per_step: float | None
    rate_steps: int  # the steps `pairs_per_s` rests on
    window: list[int] | None = None  # [first, last] step of the common window
    window_problem: str | None = None
    peak_mem_gib: list[float]
    peak_mem_gib_max: float | None
    epoch_time_s: float | None
    device_hours_per_epoch: float | None
    reference_devices: int | None = None
    raw_efficiency: float | None = None
    scaling_efficiency: float | None = None  # raw_efficiency when comparable, else None
    relative_device_hours: float | None = None
    comparable: bool = True
    not_comparable: str | None = None  # why not
    mrr_at_10: float | None = None  # the stage's test MRR@10 (a test figure, from evaluation)


class ScalingChoice(_Typed):
    stage: str
    devices: int
    device_type: Literal["cuda", "cpu"]
    label: str


class ScalingReport(_Typed):
    full_train_pairs: int | None
    full_train_pairs_source: str | None = None  # where full_train_pairs came from (the evaluation node says)
    rows: list[ScalingRow]
    most_cost_effective: ScalingChoice | None
    fastest: ScalingChoice | None
    summary: str

    def row(self, stage: str) -> ScalingRow | None:
        return next((r for r in self.rows if r.stage == stage), None)


def rate_steps(steps: int) -> int:
    """The number of steps a stage's pairs/s rests on: all but the first (warm-up) step."""
    return steps - 1 if steps > 1 else steps


def _why_not_comparable(row: ScalingRow, ref: ScalingRow) -> str | None:
    if row.window_problem or ref.window_problem:
        return row.window_problem or ref.window_problem
    if row.window is not None and ref.window is not None:
        return None  # the same steps timed in both: like with like
    a, b = row.rate_steps, ref.rate_steps
    if row is ref:
        return None
    if min(a, b) < MIN_RATE_STEPS:
        return (f"rates rest on {a} and {b} timed steps ({row.stage} vs {ref.stage}); "
                f"at least {MIN_RATE_STEPS} each are needed")
    if max(a, b) / min(a, b) > MAX_RATE_STEPS_RATIO:
        return (f"rates rest on {a} and {b} timed steps ({row.stage} vs {ref.stage}), "
                f"more than {MAX_RATE_STEPS_RATIO:g}x apart")
    return None


def device_label(devices: int, device_type: str) -> str:
    """``"4 GPUs"``, ``"1 GPU"``, ``"2 CPU processes"``."""
    if device_type == "cpu":
        return f"{devices} CPU process" + ("" if devices == 1 else "es")
    return f"{devices} GPU" + ("" if devices == 1 else "s")


def _epoch(full_train_pairs: int | None, pairs_per_s: float, devices: int) -> tuple[float | None, float | None]:
    """(epoch time in s, device-hours per epoch) at this rate, or (None, None) without a size or a rate."""
    epoch = full_train_pairs / pairs_per_s if full_train_pairs and pairs_per_s > 0 else None
    return epoch, (devices * epoch / 3600.0 if epoch is not None else None)


def _row(stage: StageResult, full_train_pairs: int | None, mrr_at_10: float | None) -> ScalingRow:
    mem = [float(m) for m in stage.peak_mem_gib]
    epoch, device_hours = _epoch(full_train_pairs, stage.pairs_per_s, stage.devices)
    return ScalingRow(
        stage=stage.stage, devices=stage.devices, device_type=stage.device_type,
        label=device_label(stage.devices, stage.device_type), wall_time_s=stage.wall_time_s,
        train_pairs=stage.train_pairs, steps=stage.steps, pairs_per_s=stage.pairs_per_s,
        pairs_per_step=stage.train_pairs / stage.steps if stage.steps else None, rate_steps=rate_steps(stage.steps),
        peak_mem_gib=mem, peak_mem_gib_max=max(mem) if mem else None, epoch_time_s=epoch,
        device_hours_per_epoch=device_hours, mrr_at_10=mrr_at_10,
    )


def _apply_common_window(group: list[tuple[ScalingRow, dict[int, float]]], full_train_pairs: int | None) -> None:
    """Time every stage of the group over the same steps (see the module text); rows are updated in place.

    ``group``: each row with its stage's ``{step: seconds}``."""
    if not group or not all(seconds and row.pairs_per_step for row, seconds in group):
        return
    first = WINDOW_WARMUP_STEPS + 1
    last = min(max(seconds) for _, seconds in group)
    for r, step_seconds in group:
        r.window, r.rate_steps = [first, last], max(0, last - first + 1)
        r.pairs_per_s_all_steps = r.pairs_per_s
        missing = [k for k in range(first, last + 1) if k not in step_seconds]
        if last - first + 1 < MIN_WINDOW_STEPS:
            r.window_problem = (f"the common window (steps {first}-{last} after {WINDOW_WARMUP_STEPS} warm-up) has "
                                f"{max(0, last - first + 1)} steps; at least {MIN_WINDOW_STEPS} are needed")
        elif missing:
            r.window_problem = (f"{r.stage} did not time steps {missing[0]}-{missing[-1]} of the common window "
                                f"{first}-{last} (resumed?)")
        if r.rate_steps and not missing:
            seconds = sum(step_seconds[k] for k in range(first, last + 1))
            r.pairs_per_s = r.pairs_per_step * r.rate_steps / seconds if seconds > 0 else float("nan")
            r.epoch_time_s, r.device_hours_per_epoch = _epoch(full_train_pairs, r.pairs_per_s, r.devices)


def _choice(row: ScalingRow) -> ScalingChoice:
    return ScalingChoice(stage=row.stage, devices=row.devices, device_type=row.device_type, label=row.label)


def scaling_report(stages: Sequence[StageResult], full_train_pairs: int | None,
                   mrr_at_10: Mapping[str, float] | None = None) -> ScalingReport:
    """Rows per stage (see the module text), the cost-effectiveness verdict and a one-line summary.

    ``mrr_at_10``: each scored stage's test MRR@10, by stage name (shown in its row)."""
    timed = [(_row(s, full_train_pairs, (mrr_at_10 or {}).get(s.stage)),
              {int(k): float(v) for k, v in s.step_seconds}) for s in stages]
    rows = [row for row, _ in timed]
    for device_type in {r.device_type for r in rows}:
        _apply_common_window([(r, t) for r, t in timed if r.device_type == device_type], full_train_pairs)
        group = [r for r in rows if r.device_type == device_type]
        ref = min(group, key=lambda r: (r.devices, -r.pairs_per_s))
        per_device = ref.pairs_per_s / ref.devices
        for r in group:
            r.reference_devices = ref.devices
            r.raw_efficiency = r.pairs_per_s / (r.devices * per_device) if per_device > 0 else None
            if r.device_hours_per_epoch is not None and ref.device_hours_per_epoch:
                r.relative_device_hours = r.device_hours_per_epoch / ref.device_hours_per_epoch
            why = _why_not_comparable(r, ref)
            r.comparable, r.not_comparable = why is None, why
            r.scaling_efficiency = r.raw_efficiency if why is None else None
            if why is not None:
                r.relative_device_hours = None
    costed = [r for r in rows if r.device_hours_per_epoch is not None]
    best = min(costed, key=lambda r: (r.device_hours_per_epoch, r.epoch_time_s, r.devices)) if costed else None
    fastest = min(costed, key=lambda r: (r.epoch_time_s, r.devices)) if costed else None
    if best is None:
        summary = ("No stage ran, so there is no scaling verdict." if not rows else
                   "The full training-set size is unknown, so no epoch time or cost could be projected.")
    else:
        unit = "GPU-hours" if best.device_type == "cuda" else "CPU-process-hours"
        efficiency = (f"{100 * best.scaling_efficiency:.0f}% scaling efficiency"
                      if best.scaling_efficiency is not None else
                      f"scaling efficiency not comparable: {best.not_comparable}")
        summary = (
            f"Most cost-effective: {best.label} ({best.stage}), "
            f"{best.device_hours_per_epoch:.3g} {unit} per epoch at {efficiency}"
        )
        if fastest is not None and fastest is not best:
            fast_unit = "GPU-hours" if fastest.device_type == "cuda" else "CPU-process-hours"
            summary += (
                f"; fastest: {fastest.label} ({fastest.stage}), "
                f"{fastest.epoch_time_s / 3600:.3g} h per epoch for "
                f"{fastest.device_hours_per_epoch:.3g} {fast_unit}"
            )
        summary += "."
    return ScalingReport(full_train_pairs=full_train_pairs, rows=rows,
                         most_cost_effective=_choice(best) if best else None,
                         fastest=_choice(fastest) if fastest else None, summary=summary)
