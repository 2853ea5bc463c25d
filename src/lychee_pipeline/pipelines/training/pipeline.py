"""Staged training, wired from one stage template reused under Kedro namespaces.

`train_stage_<n>` runs the check stage on n devices (n = 1, 2, 4, ... one slot per rung of the ladder, see
`training.planning.CHECK_RUNGS`) and `train_stage_final` the final stage on `gpus`; kedro-viz shows each
namespace as a collapsible group, nested in the `training` group of the registered pipelines
(`pipeline_registry.py`: node `training.train_stage_1.run_stage`). Which slots run is decided by the plan (`TrainingPlan.stage_slots`): with
gpus=4 the slots on 1 and 2 devices run, the others pass None on.
"""

from __future__ import annotations

from kedro.pipeline import Node, Pipeline

from lychee_pipeline.training.planning import rung_devices

from .nodes import (
    assign_stage_slots,
    check_stage,
    collect_stage_results,
    export_training_table,
    final_stage_slot,
    plan_smoke_training,
    plan_training,
    run_stage_slot,
)

SLOTS = [f"train_stage_{n}" for n in rung_devices()] + ["train_stage_final"]


def stage_template() -> Pipeline:
    """One stage: run (or reuse) it, then gate it. `after` is the dataset it waits for."""
    return Pipeline([
        Node(run_stage_slot, ["training_data_path", "training_plan", "slot", "after"], "launched",
             name="run_stage", tags=["training"]),
        Node(check_stage, ["launched", "training_plan"], "result", name="gate_stage", tags=["training"]),
    ])


def _stage(namespace: str, after: str) -> Pipeline:
    """The template under `namespace`; its slot comes in as `<namespace>_slot`, its result leaves as `<namespace>_result`."""
    tag = namespace.removeprefix("train_")  # stage_1, stage_2, ..., stage_final: kedro-viz filters on it
    return Pipeline(stage_template(), namespace=namespace, tags=[tag],
                    inputs={"training_data_path": "training_data_path", "training_plan": "training_plan",
                            "slot": f"{namespace}_slot", "after": after},
                    outputs={"result": f"{namespace}_result"})


def create_pipeline(**kwargs) -> Pipeline:
    """The full staged training pipeline: plan, export, the check stages in ladder order, the final stage."""
    stages, after = [], "training_data_path"  # the first stage follows the table's export
    for namespace in SLOTS:
        stages.append(_stage(namespace, after))
        after = f"{namespace}_result"
    return Pipeline([
        Node(plan_training,
             ["params:model", "params:training", "params:stages", "params:gpus", "params:device", "params:run"],
             "training_plan", name="plan_training_stages", tags=["training"]),
        Node(export_training_table, ["train_records", "training_plan"], "training_data_path",
             name="export_training_table", tags=["training"]),
        Node(assign_stage_slots, "training_plan", [f"{ns}_slot" for ns in SLOTS], name="assign_stage_slots",
             tags=["training"]),
        *stages,
        Node(collect_stage_results, [f"{ns}_result" for ns in SLOTS], "stage_results", name="collect_stage_results",
             tags=["training"]),
    ])


def create_smoke_pipeline(**kwargs) -> Pipeline:
    """Smoke training: the final stage alone, on one device for a few steps, on the smoke subset."""
    return Pipeline([
        Node(plan_smoke_training,
             ["params:model", "params:training", "params:stages", "params:device", "params:run", "params:smoke"],
             "training_plan", name="plan_smoke_training", tags=["training"]),
        Node(export_training_table, ["smoke_train_records", "training_plan"], "training_data_path",
             name="export_training_table", tags=["training"]),
        Node(final_stage_slot, "training_plan", "train_stage_final_slot", name="assign_final_stage_slot",
             tags=["training"]),
        _stage("train_stage_final", "training_data_path"),
        Node(collect_stage_results, "train_stage_final_result", "stage_results", name="collect_stage_results",
             tags=["training"]),
    ])
