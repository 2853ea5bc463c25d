"""Training nodes: thin wrappers over `lychee_pipeline.training` (planning, the stage contract, the gate).

Typed from the parameters on: `plan_training` validates the YAML blocks once into a `TrainingPlan`, which the
catalog stores as JSON and gives back typed (`PydanticJSONDataset`); the slots travel as `StageSlot`s in
memory. Only a gated stage result leaves as a dict, for its JSON dataset and the `stage_results` list.
"""

from __future__ import annotations

import logging
from typing import Any

import pyarrow as pa

from lychee_pipeline.training import gate, planning
from lychee_pipeline.training.planning import StageSlot, TrainingPlan, UnusedSlot, slot_outcome
from lychee_pipeline.training.stage import StageOutcome

__all__ = ["assign_stage_slots", "check_stage", "collect_stage_results", "export_training_table",
           "final_stage_slot", "plan_smoke_training", "plan_training", "run_stage_slot"]

log = logging.getLogger(__name__)


def plan_training(model: dict, training: dict, stages: dict, gpus: int, device: str, run: dict,
                  overrides: dict | None = None) -> TrainingPlan:
    """Validate the parameters and lay out the stages before anything launches."""
    return planning.plan_training(model, training, stages, gpus, device, run, overrides)


def plan_smoke_training(model: dict, training: dict, stages: dict, device: str, run: dict, smoke: dict
                        ) -> TrainingPlan:
    """Plan the smoke run: one stage on one device, with the `smoke` overrides."""
    run = {**run, "name": smoke.get("run_name", "smoke")}
    return plan_training({**model, **(smoke.get("model") or {})}, training, stages, 1, device, run,
                         overrides=smoke.get("training"))


def assign_stage_slots(plan: TrainingPlan) -> list[StageSlot]:
    """One slot per check rung, then the final stage (a rung the ladder does not need runs nothing)."""
    slots = plan.stage_slots()
    unused = [f"train_stage_{d}" for d, slot in zip(planning.rung_devices(), slots) if slot.devices is None]
    if unused:  # Kedro still logs "Running node" for each of them
        log.info("stage slots %s are not used with gpus=%d (its stages: %s devices): the pipeline has one slot per "
                 "power of two up to %d, since Kedro's graph is fixed, so Kedro lists these as run and completed "
                 "nodes and kedro-viz shows them, but they launch nothing", ", ".join(unused), plan.gpus,
                 " -> ".join(map(str, plan.ladder)), planning.rung_devices()[-1])
    return slots


def final_stage_slot(plan: TrainingPlan) -> StageSlot:
    """The final stage's slot alone (the smoke run has no check stages)."""
    return plan.stage_slots()[-1]


def export_training_table(train_records: pa.Table, plan: TrainingPlan) -> str:
    """Write the training split once per run as Parquet, for the stage processes to memory-map."""
    return planning.export_training_table(train_records, plan)


def run_stage_slot(training_data: str, plan: TrainingPlan, slot: StageSlot, after: Any = None
                   ) -> StageOutcome | UnusedSlot:
    """Run the slot's stage (`after`: the dataset it waits for), or say why this run's ladder has none there."""
    if slot.devices is None:
        return UnusedSlot(reason=f"gpus={plan.gpus}: the ladder {plan.ladder} has no check stage here")
    return planning.run_training_stage(training_data, plan, slot.devices, slot.final)


def check_stage(result: StageOutcome | UnusedSlot, plan: TrainingPlan) -> dict:
    """The gate between stages: raises StageGateError, or passes the result on (an unused slot too) as JSON."""
    if not isinstance(result, UnusedSlot):
        gate.check_stage(result, plan.stages.gate)
    return result.model_dump()


def collect_stage_results(*results: dict) -> list[dict]:
    """The stages that ran, in ladder order."""
    return [r for r in results if not isinstance(slot_outcome(r), UnusedSlot)]
