"""Training nodes: thin wrappers over `lychee_pipeline.training` (planning, the stage contract, the gate).

The catalog holds the plan, the stage slots and each stage's result as JSON-able dicts; the nodes turn them
into their typed models (`TrainingPlan`, `StageSlot`, `StageResult`) and back.
"""

from __future__ import annotations

import logging
from typing import Any

import pyarrow as pa

from lychee_pipeline.training import gate, planning
from lychee_pipeline.training.gate import StageGateError
from lychee_pipeline.training.planning import ParameterError, StageSlot, TrainingPlan, UnusedSlot, slot_outcome

__all__ = ["ParameterError", "StageGateError", "assign_stage_slots", "check_stage", "collect_stage_results",
           "export_training_table", "final_stage_slot", "plan_smoke_training", "plan_training", "run_stage_slot",
           "run_training_stage"]

log = logging.getLogger(__name__)


def plan_training(model: dict, training: dict, stages: dict, gpus: int, device: str, run: dict,
                  overrides: dict | None = None) -> dict[str, Any]:
    """Validate the parameters and lay out the stages before anything launches."""
    return planning.plan_training(model, training, stages, gpus, device, run, overrides).model_dump()


def plan_smoke_training(model: dict, training: dict, stages: dict, device: str, run: dict, smoke: dict) -> dict:
    """Plan the smoke run: one stage on one device, with the `smoke` overrides."""
    run = {**run, "name": smoke.get("run_name", "smoke")}
    return plan_training({**model, **(smoke.get("model") or {})}, training, stages, 1, device, run,
                         overrides=smoke.get("training"))


def assign_stage_slots(plan: dict) -> list[dict]:
    """One slot per check rung, then the final stage (a rung the ladder does not need runs nothing)."""
    typed_plan = TrainingPlan.model_validate(plan)
    slots = typed_plan.stage_slots()
    unused = [f"train_stage_{d}" for d, slot in zip(planning.rung_devices(), slots) if slot.devices is None]
    if unused:  # Kedro still logs "Running node" for each of them
        log.info("stage slots %s are not used with gpus=%d (its stages: %s devices): the pipeline has one slot per "
                 "power of two up to %d, since Kedro's graph is fixed, so Kedro lists these as run and completed "
                 "nodes and kedro-viz shows them, but they launch nothing", ", ".join(unused), typed_plan.gpus,
                 " -> ".join(map(str, typed_plan.ladder)), planning.rung_devices()[-1])
    return [slot.model_dump() for slot in slots]


def final_stage_slot(plan: dict) -> dict:
    """The final stage's slot alone (the smoke run has no check stages)."""
    return TrainingPlan.model_validate(plan).stage_slots()[-1].model_dump()


def export_training_table(train_records: pa.Table, plan: dict) -> str:
    """Write the training split once per run as Parquet, for the stage processes to memory-map."""
    return planning.export_training_table(train_records, TrainingPlan.model_validate(plan))


def run_training_stage(training_data: str, plan: dict, devices: int, final: bool) -> dict[str, Any]:
    """Launch (or reuse) one stage and return its result."""
    return planning.run_training_stage(training_data, TrainingPlan.model_validate(plan), devices, final).model_dump()


def run_stage_slot(training_data: str, plan: dict, slot: dict, after: Any = None) -> dict:
    """Run the slot's stage (`after`: the dataset it waits for), or say why this run's ladder has none there."""
    slot, typed_plan = StageSlot.model_validate(slot), TrainingPlan.model_validate(plan)
    if slot.devices is None:
        return UnusedSlot(reason=f"gpus={typed_plan.gpus}: the ladder {typed_plan.ladder} has no check stage here"
                          ).model_dump()
    return planning.run_training_stage(training_data, typed_plan, slot.devices, slot.final).model_dump()


def check_stage(result: dict, plan: dict) -> dict:
    """The gate between stages: raises StageGateError, or passes the result on (an unused slot too)."""
    outcome = slot_outcome(result)
    if not isinstance(outcome, UnusedSlot):
        gate.check_stage(outcome, TrainingPlan.model_validate(plan).stages.gate)
    return result  # passed on as it is


def collect_stage_results(*results: dict) -> list[dict]:
    """The stages that ran, in ladder order."""
    return [r for r in results if not isinstance(slot_outcome(r), UnusedSlot)]
