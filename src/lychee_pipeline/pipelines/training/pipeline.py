"""Staged training: check stages on 1, 2, 4, 8 devices (those below `gpus`), then the final stage on `gpus`.

The node structure is fixed so kedro-viz shows the staging; a check stage whose device count is not
below `gpus` passes through without launching anything (gpus=4 runs 1 -> 2 -> final 4).
"""

from __future__ import annotations

from kedro.pipeline import Node, Pipeline

from .nodes import check_stage, collect_stage_results, export_training_table, plan_training, run_training_stage

CHECK_STAGES = (1, 2, 4, 8)


def _check_stage_node(devices: int):
    def train_check_stage(training_data: str, plan: dict, previous: dict | None = None) -> dict:
        """Run a short check stage on `devices` devices when gpus is larger, else skip."""
        if devices not in plan["ladder"][:-1]:
            return {"stage": f"check_{devices}", "devices": devices, "skipped": True}
        return check_stage(run_training_stage(training_data, plan, devices, final=False), plan)

    train_check_stage.__name__ = f"train_check_stage_{devices}"
    return train_check_stage


def train_final_stage(training_data: str, plan: dict, previous: dict | None = None) -> dict:
    """Run the final stage on `gpus` devices for the configured epochs, then gate it."""
    return check_stage(run_training_stage(training_data, plan, plan["gpus"], final=True), plan)


def _plan_smoke(model: dict, training: dict, stages: dict, device: str, run: dict, smoke: dict) -> dict:
    """Plan the smoke run: one stage on one device for `smoke.max_steps` steps."""
    run = {**run, "name": smoke.get("run_name", "smoke")}
    model = {**model, **(smoke.get("model") or {})}
    return plan_training(model, training, stages, 1, device, run, overrides=smoke.get("training"))


def create_pipeline(**kwargs) -> Pipeline:
    """The full staged training pipeline."""
    nodes = [
        Node(
            plan_training,
            ["params:model", "params:training", "params:stages", "params:gpus", "params:device", "params:run"],
            "training_plan",
            name="plan_training_stages",
            tags=["training"],
        ),
        Node(export_training_table, ["train_records", "training_plan"], "training_data_path",
             name="export_training_table", tags=["training"]),
    ]
    previous = None
    for devices in CHECK_STAGES:
        inputs = ["training_data_path", "training_plan"] + ([previous] if previous else [])
        output = f"stage_{devices}_result"
        nodes.append(Node(_check_stage_node(devices), inputs, output, name=f"train_check_stage_{devices}",
                          tags=["training", f"stage_{devices}"]))
        previous = output
    nodes.append(Node(train_final_stage, ["training_data_path", "training_plan", previous], "final_stage_result",
                      name="train_final_stage", tags=["training", "stage_final"]))
    nodes.append(Node(collect_stage_results, [f"stage_{d}_result" for d in CHECK_STAGES] + ["final_stage_result"],
                      "stage_results", name="collect_stage_results", tags=["training"]))
    return Pipeline(nodes)


def create_smoke_pipeline(**kwargs) -> Pipeline:
    """Smoke training: one stage on one device for a few steps, on the smoke subset."""
    return Pipeline(
        [
            Node(
                _plan_smoke,
                ["params:model", "params:training", "params:stages", "params:device", "params:run",
                 "params:smoke"],
                "training_plan",
                name="plan_smoke_training",
                tags=["training"],
            ),
            Node(export_training_table, ["smoke_train_records", "training_plan"], "training_data_path",
                 name="export_training_table", tags=["training"]),
            Node(train_final_stage, ["training_data_path", "training_plan"], "final_stage_result",
                 name="train_smoke_stage", tags=["training", "stage_final"]),
            Node(collect_stage_results, ["final_stage_result"], "stage_results", name="collect_stage_results",
                 tags=["training"]),
        ]
    )
