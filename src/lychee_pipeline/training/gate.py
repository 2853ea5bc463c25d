"""The gate between stages, Kedro-free: a stage's result must show a finite loss, a falling loss from
`stages.gate.check_loss_fall_from_devices` devices on, its learning-rate schedule followed to the end, and
replicas in sync; otherwise the run stops with a `StageGateError` naming the check and the stage's log."""

from __future__ import annotations

import logging
import math

from lychee_pipeline.training.config import GateParams
from lychee_pipeline.training.schedule import Schedule
from lychee_pipeline.training.stage import MachineShare, StageOutcome, StageResult

log = logging.getLogger(__name__)


class StageGateError(RuntimeError):
    """A stage gate check failed; the message names the check and the stage's logs."""


def schedule_problem(result: StageResult) -> str | None:
    """Why the stage's logged learning rates do not follow its schedule to the end, or None."""
    if result.schedule is None or result.steps != result.schedule["total_steps"]:
        return None  # a stage stopped early, or a result from before schedules were recorded
    schedule = Schedule(**result.schedule)
    if len(result.learning_rates) != result.steps:
        return f"{len(result.learning_rates)} learning rates logged for {result.steps} steps"
    last_step, last_lr = result.learning_rates[-1]
    expected = schedule.lr_at(last_step)
    if abs(last_lr - expected) > 1e-9 * schedule.base_lr + 1e-15:
        return f"final learning rate {last_lr:.3e} at step {last_step}, the schedule ends at {expected:.3e}"
    return None


def check_stage(result: StageOutcome, gate: GateParams) -> StageOutcome:
    """The gate between stages: finite loss, a falling loss from 2 devices on, replicas in sync."""
    if isinstance(result, MachineShare):  # multi-node: machine rank 0 holds the result and gates it
        log.info("stage %s: machine rank %d trained its part; the gate runs on machine rank 0", result.stage,
                 result.machine_rank)
        return result
    where = f"(logs: {result.launch_log})"
    losses = [loss for _, loss in result.losses]
    if gate.require_finite and (not losses or not all(math.isfinite(x) for x in losses)):
        bad = next((step for step, loss in result.losses if not math.isfinite(loss)), None)
        if bad is None and result.skipped_steps:  # every step was skipped as non-finite
            bad = result.skipped_steps[0][0]
        raise StageGateError(f"gate 'finite loss' failed for {result.stage}: non-finite loss at step {bad} {where}")
    if result.devices >= gate.check_loss_fall_from_devices and len(losses) >= 3:
        third = max(1, len(losses) // 3)
        first, last = sum(losses[:third]) / third, sum(losses[-third:]) / third
        if last > first * (1 + gate.loss_fall_tolerance):
            raise StageGateError(
                f"gate 'loss falls' failed for {result.stage}: mean loss {first:.4f} over the first third "
                f"vs {last:.4f} over the last (tolerance {gate.loss_fall_tolerance}) {where}"
            )
    lr_problem = schedule_problem(result)
    if lr_problem:
        raise StageGateError(f"gate 'learning-rate schedule' failed for {result.stage}: {lr_problem} {where}")
    if result.replica_max_diff > gate.replica_tolerance:
        raise StageGateError(
            f"gate 'replicas in sync' failed for {result.stage}: parameters differ across ranks by "
            f"{result.replica_max_diff:.3g} > {gate.replica_tolerance} {where}"
        )
    log.info("gate passed for %s: final loss %.4f, %.1f pairs/s", result.stage, losses[-1], result.pairs_per_s)
    return result
