"""Training nodes: plan the stages, run each as real Accelerate processes, gate between them."""

from __future__ import annotations

import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from lychee_pipeline.training.config import ModelParams, StageParams, TrainingParams, stage_devices
from lychee_pipeline.training.launch import StageFailed, check_device_count, resolve_device, run_stage

log = logging.getLogger(__name__)


class StageGateError(RuntimeError):
    """A stage gate check failed; the message names the check and the stage's logs."""


def plan_training(
    model: dict, training: dict, stages: dict, gpus: int, device: str, run: dict, overrides: dict | None = None
) -> dict[str, Any]:
    """Validate the parameters and lay out the stages (1, 2, 4, ... up to `gpus`) before anything launches."""
    model_params = ModelParams(**model)
    training_params = TrainingParams(**{**training, **(overrides or {})})
    stage_params = StageParams(**stages)
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise ValueError(f"parameter gpus must be a positive integer, got {gpus!r}")
    device_type = resolve_device(device)
    check_device_count(gpus, device_type)
    if device_type == "cpu":
        log.info("no CUDA device in use: gpus=%d runs as %d CPU processes (gloo)", gpus, gpus)
    if model_params.finetune == "qlora" and device_type != "cuda":
        raise ValueError("model.finetune=qlora needs a CUDA GPU (bitsandbytes 4-bit); use lora or full on CPU")
    ladder = stage_devices(gpus)
    run_dir = Path(run["output_root"]) / run["name"]
    log.info("training plan: stages on %s device(s), outputs in %s", " -> ".join(map(str, ladder)), run_dir)
    return {
        "device_type": device_type,
        "gpus": gpus,
        "ladder": ladder,
        "run_dir": str(run_dir),
        "model": model_params.model_dump(),
        "training": training_params.model_dump(),
        "stages": stage_params.model_dump(),
        "strategy_templates": run.get("accelerate_templates", "conf/base/accelerate"),
    }


def export_training_table(train_records: pa.Table, plan: dict) -> str:
    """Write the training split once per run as Parquet, for the stage processes to memory-map."""
    path = Path(plan["run_dir"]) / "train.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".parquet.tmp")
    pq.write_table(train_records, tmp)
    os.replace(tmp, path)
    log.info("training table: %d records -> %s", train_records.num_rows, path)
    return str(path)


def _tracking_env() -> dict[str, str]:
    """Parent MLflow run (opened by kedro-mlflow) and store, for rank 0 of the children."""
    try:
        import mlflow
    except ImportError:
        return {}
    active = mlflow.active_run()
    if active is None:
        return {}
    uri = mlflow.get_tracking_uri()
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = "sqlite:///" + str(Path(uri[len("sqlite:///") :]).resolve())
    return {
        "MLFLOW_TRACKING_URI": uri,
        "LYCHEE_MLFLOW_PARENT_RUN_ID": active.info.run_id,
        "LYCHEE_MLFLOW_EXPERIMENT_ID": active.info.experiment_id,
    }


def _strategy_template(plan: dict) -> dict | None:
    strategy = plan["training"]["launch"]["strategy"]
    if strategy == "ddp":
        return None
    path = Path(plan["strategy_templates"]) / f"{strategy}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"training.launch.strategy={strategy}: no Accelerate template at {path}")
    return yaml.safe_load(path.read_text())


def run_training_stage(training_data: str, plan: dict, devices: int, final: bool) -> dict[str, Any]:
    """Launch one stage (a short check, or the final run for the configured epochs) and return its result."""
    name = f"stage_{devices}{'gpu' if plan['device_type'] == 'cuda' else 'cpu'}" + ("_final" if final else "")
    stage_dir = Path(plan["run_dir"]) / name
    training = dict(plan["training"])
    if not final:
        checks = plan["stages"]["check_steps"]
        training["max_steps"] = checks.get(devices, checks.get(str(devices), plan["stages"]["default_check_steps"]))
    if not training["resume"] and stage_dir.exists():
        shutil.rmtree(stage_dir)
    spec = {
        "stage": name,
        "data_path": training_data,
        "output_dir": str(stage_dir),
        "model": {k: v for k, v in plan["model"].items() if k != "lora"}
        | {f"lora_{k}": v for k, v in plan["model"]["lora"].items() if v is not None},
        "training": training,
    }
    result = run_stage(stage_dir, spec, devices, plan["device_type"], _strategy_template(plan), _tracking_env())
    result["final"] = final
    return result


def check_stage(result: dict, plan: dict) -> dict:
    """The gate between stages: finite loss, a falling loss from 2 devices on, replicas in sync."""
    gate, where = plan["stages"]["gate"], f"(logs: {Path(result['adapter_dir']).parent / 'launch.log'})"
    losses = [loss for _, loss in result["losses"]]
    if gate["require_finite"] and (not losses or not all(math.isfinite(x) for x in losses)):
        bad = next((step for step, loss in result["losses"] if not math.isfinite(loss)), None)
        raise StageGateError(f"gate 'finite loss' failed for {result['stage']}: non-finite loss at step {bad} {where}")
    if result["devices"] >= gate["check_loss_fall_from_devices"] and len(losses) >= 3:
        third = max(1, len(losses) // 3)
        first, last = sum(losses[:third]) / third, sum(losses[-third:]) / third
        if last > first * (1 + gate["loss_fall_tolerance"]):
            raise StageGateError(
                f"gate 'loss falls' failed for {result['stage']}: mean loss {first:.4f} over the first third "
                f"vs {last:.4f} over the last (tolerance {gate['loss_fall_tolerance']}) {where}"
            )
    if result["replica_max_diff"] > gate["replica_tolerance"]:
        raise StageGateError(
            f"gate 'replicas in sync' failed for {result['stage']}: parameters differ across ranks by "
            f"{result['replica_max_diff']:.3g} > {gate['replica_tolerance']} {where}"
        )
    log.info("gate passed for %s: final loss %.4f, %.1f pairs/s", result["stage"], losses[-1], result["pairs_per_s"])
    return result


def collect_stage_results(*results: dict | None) -> list[dict]:
    """The stages that ran, in order (skipped check stages are None)."""
    return [r for r in results if r is not None]
