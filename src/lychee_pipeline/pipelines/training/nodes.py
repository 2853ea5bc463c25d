"""Training nodes: plan the stages, run each as real Accelerate processes, gate between them."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from pydantic import BaseModel, ValidationError

from lychee_pipeline.training import checkpoints
from lychee_pipeline.training.config import ModelParams, StageParams, TrainingParams, stage_devices
from lychee_pipeline.training.launch import (
    StageFailed,
    check_device_count,
    check_stage_lock,
    resolve_device,
    run_stage,
)
from lychee_pipeline.training.schedule import Schedule

log = logging.getLogger(__name__)


class StageGateError(RuntimeError):
    """A stage gate check failed; the message names the check and the stage's logs."""


class ParameterError(ValidationError):
    """A bad parameter, in one line naming it (`invalid parameter training.learning_rate: ...`).

    A pydantic ValidationError (and so a ValueError) whose message is one line instead of pydantic's block.
    """

    def __str__(self) -> str:
        return "; ".join(
            "invalid parameter " + ".".join([self.title, *map(str, e["loc"])]) + f": {e['msg']}"
            + (f" (got {e['input']!r})" if not isinstance(e.get("input"), dict) else "")
            for e in self.errors(include_url=False)
        )


def _validated(cls: type[BaseModel], section: str, values: dict) -> BaseModel:
    try:
        return cls(**values)
    except ValidationError as error:
        errors = [{k: v for k, v in e.items() if k in {"type", "loc", "input", "ctx"}} for e in error.errors()]
        for e in errors:  # value errors carry the exception object; keep its message only
            if "ctx" in e:
                e["ctx"] = {k: str(v) for k, v in e["ctx"].items()}
        raise ParameterError.from_exception_data(section, errors) from None


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def check_model_source(name_or_path: str) -> None:
    """`model.name_or_path` must be builtin:tiny, an existing folder, or a hub id (org/name)."""
    if name_or_path.startswith("builtin:"):
        if name_or_path != "builtin:tiny":
            raise ValueError(f"invalid parameter model.name_or_path: unknown built-in model {name_or_path!r} "
                             "(only builtin:tiny)")
        return
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return
    if path.exists():
        raise ValueError(f"invalid parameter model.name_or_path: {name_or_path!r} is a file, not a model folder")
    if not _HUB_ID.match(name_or_path) or name_or_path.startswith((".", "/", "~")):
        raise ValueError(f"invalid parameter model.name_or_path: no such folder {name_or_path!r} "
                         "(and not a hub id of the form org/name)")


def check_strategy(strategy: str, device_type: str) -> None:
    """Refuse, in one line before anything launches, a sharded strategy that cannot run here.

    fsdp2 on CPU: Accelerate (1.16) sets up FSDP only for GPU-type devices; with the CPU it quietly makes the
    processes plain gloo DDP (`DistributedType.MULTI_CPU`, full unsharded checkpoints), so the template would
    be ignored without a word. DeepSpeed is not installed here and its ZeRO needs CUDA GPUs.
    """
    if strategy == "fsdp2" and device_type != "cuda":
        raise ValueError("invalid parameter training.launch.strategy: fsdp2 runs on CUDA GPUs only (Accelerate "
                         "sets up FSDP for GPUs; on CPU it would silently train plain DDP); on CPU use ddp")
    if strategy in ("zero2", "zero3"):
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            raise ValueError(f"invalid parameter training.launch.strategy: {strategy} needs DeepSpeed, which is not "
                             "installed (pip install deepspeed, on a machine with CUDA GPUs); use ddp or fsdp2")
        if device_type != "cuda":
            raise ValueError(f"invalid parameter training.launch.strategy: {strategy} (DeepSpeed ZeRO) runs on CUDA "
                             "GPUs only here; on CPU use ddp or fsdp2")


def plan_training(
    model: dict, training: dict, stages: dict, gpus: int, device: str, run: dict, overrides: dict | None = None
) -> dict[str, Any]:
    """Validate the parameters and lay out the stages (1, 2, 4, ... up to `gpus`) before anything launches.

    A bad parameter raises ParameterError (a ValueError) in one line naming it, e.g.
    `invalid parameter training.learning_rate: Input should be greater than 0 (got -0.0001)`.
    """
    model_params = _validated(ModelParams, "model", model)
    training_params = _validated(TrainingParams, "training", {**training, **(overrides or {})})
    stage_params = _validated(StageParams, "stages", stages)
    if model_params.trust_remote_code:
        raise ValueError("invalid parameter model.trust_remote_code: remote code is never run "
                         "(Qwen2.5-VL is a native transformers model); set it to false")
    check_model_source(model_params.name_or_path)
    launch = training_params.launch
    if launch.machine_rank >= launch.num_machines:
        raise ValueError(f"invalid parameter training.launch.machine_rank: {launch.machine_rank} must be below "
                         f"training.launch.num_machines {launch.num_machines}")
    if launch.num_machines > 1 and not launch.main_process_port:
        raise ValueError("invalid parameter training.launch.main_process_port: a multi-node run needs the same "
                         "fixed port on every machine (null picks a free one on each)")
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise ValueError(f"parameter gpus must be a positive integer, got {gpus!r}")
    device_type = resolve_device(device)
    check_device_count(gpus, device_type)
    if device_type == "cpu":
        log.info("no CUDA device in use: gpus=%d runs as %d CPU processes (gloo)", gpus, gpus)
    if model_params.finetune == "qlora" and device_type != "cuda":
        raise ValueError("model.finetune=qlora needs a CUDA GPU (bitsandbytes 4-bit); use lora or full on CPU")
    check_strategy(training_params.launch.strategy, device_type)
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


def short_group_counts(records: pa.Table, group_size: int) -> dict[str, int]:
    """How many records have fewer than ``group_size - 1`` negatives, the fewest any record has, and the
    group slots a pass over ``records`` fills with random negatives (``training.negative_fill: fill_random``)."""
    import pyarrow.compute as pc

    need = group_size - 1
    if not records.num_rows:
        return {"records": 0, "short_records": 0, "fewest_negatives": 0, "filled_slots_per_epoch": 0}
    lengths = pc.fill_null(pc.list_value_length(records.column("negatives")), 0)
    missing = pc.max_element_wise(pc.subtract(need, lengths), 0)
    return {
        "records": records.num_rows,
        "short_records": pc.sum(pc.greater(missing, 0)).as_py() or 0,
        "fewest_negatives": pc.min(lengths).as_py() or 0,
        "filled_slots_per_epoch": pc.sum(missing).as_py() or 0,
    }


def _distinct_documents(records: pa.Table) -> int:
    """Distinct documents (by doc_id) among the records' positives and negatives."""
    import pyarrow.compute as pc

    ids = [pc.struct_field(pc.list_flatten(records.column(c)), "doc_id") for c in ("positives", "negatives")]
    return len(pc.unique(pa.chunked_array([chunk for col in ids for chunk in col.chunks], pa.string())))


def export_training_table(train_records: pa.Table, plan: dict) -> str:
    """Write the training split once per run as Parquet, for the stage processes to memory-map.

    Records with fewer than ``training.group_size - 1`` negatives: under ``training.negative_fill: refuse``
    the run stops here with a one-line error naming both keys; under ``fill_random`` their groups are filled
    from other records' documents at batch time, and the number of filled slots per epoch is logged.
    """
    group_size = plan["training"]["group_size"]
    policy = plan["training"].get("negative_fill", "refuse")
    short = short_group_counts(train_records, group_size)
    if short["short_records"]:
        where = (f"{short['short_records']} of {short['records']} training records have fewer than "
                 f"{group_size - 1} negatives (fewest: {short['fewest_negatives']})")
        if policy == "refuse":
            raise ValueError(
                f"invalid parameters training.group_size={group_size} with training.negative_fill=refuse: {where}; "
                f"set data_processing.normalization.min_negatives to at least {group_size - 1} (short records are "
                "quarantined), lower training.group_size, or use training.negative_fill=fill_random"
            )
        distinct = _distinct_documents(train_records)
        if distinct < group_size:
            raise ValueError(
                f"invalid parameters training.group_size={group_size} with training.negative_fill=fill_random: "
                f"{where}, and the training split has only {distinct} distinct documents to draw from; lower "
                "training.group_size or raise data_processing.normalization.min_negatives"
            )
        log.info("negative_fill=fill_random: %s; %d group slot(s) per epoch are filled with random negatives "
                 "from other records' documents (hard=false)", where, short["filled_slots_per_epoch"])
    path = Path(plan["run_dir"]) / "train.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_file() and pq.read_table(path, memory_map=True).equals(train_records):
        # the same rows as last time: keep the file's bytes, so finished stages (hashed with them) are reused
        log.info("training table: %d records, unchanged -> %s", train_records.num_rows, path)
        return str(path)
    tmp = path.with_suffix(".parquet.tmp")
    try:
        pq.write_table(train_records, tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # disk full: the previous table stays intact, no half-written file left
        raise
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


# Spec keys that do not change what a stage computes: a finished stage is reused across them.
_NOT_HASHED = {"resume", "reuse_finished"}
_NOT_HASHED_LAUNCH = {"timeout_s", "process_group_timeout_s", "main_process_port", "watchdog_s",
                      "hang_after_exit_s", "rendezvous_timeout_s"}


def spec_hash(spec: dict[str, Any]) -> str:
    """sha256 of what determines a stage's outcome: its spec (less timeouts / resume flags) and its data bytes.

    Locations (the stage folder, the data file's path) are not hashed, so a copied or moved project reuses
    its finished stages; the data file's bytes are.
    """
    training = {k: v for k, v in spec["training"].items() if k not in _NOT_HASHED}
    training["launch"] = {k: v for k, v in training["launch"].items() if k not in _NOT_HASHED_LAUNCH}
    outcome = {k: v for k, v in spec.items() if k not in ("output_dir", "data_path", "spec_hash")}
    digest = hashlib.sha256(json.dumps({**outcome, "training": training}, sort_keys=True, default=str).encode())
    digest.update(checkpoints.sha256_file(Path(spec["data_path"])).encode())
    return digest.hexdigest()


def reusable_result(stage_dir: Path, wanted_hash: str) -> tuple[dict | None, str]:
    """A finished stage's result if its spec hash matches and its adapter verifies, else (None, why not)."""
    result_path = stage_dir / "result.json"
    if not result_path.is_file():
        return None, "no result.json"
    try:
        result = json.loads(result_path.read_text())
    except ValueError as exc:
        return None, f"unreadable result.json: {exc}"
    if result.get("spec_hash") != wanted_hash:
        return None, "parameters or training data changed (spec hash differs)"
    if not result.get("adapter_manifest") or not result.get("adapter_dir"):
        return None, "no adapter manifest recorded"
    # Read where the stage folder is now (a copied or moved project), not where it was written.
    adapter_dir, manifest = stage_dir / Path(result["adapter_dir"]).name, stage_dir / Path(result["adapter_manifest"]).name
    problem = checkpoints.verify_folder(adapter_dir, manifest)
    if problem:
        return None, f"adapter does not verify: {problem}"
    return {**result, "adapter_dir": str(adapter_dir), "adapter_manifest": str(manifest)}, \
        "finished, spec and adapter unchanged"


def run_training_stage(training_data: str, plan: dict, devices: int, final: bool) -> dict[str, Any]:
    """Launch one stage (a short check, or the final run for the configured epochs) and return its result.

    With `training.reuse_finished` a stage whose result.json records the same spec hash and whose adapter
    matches its sha256 manifest is not launched again: its stored result is returned.
    """
    name = f"stage_{devices}{'gpu' if plan['device_type'] == 'cuda' else 'cpu'}" + ("_final" if final else "")
    stage_dir = Path(plan["run_dir"]) / name
    training = dict(plan["training"])
    if not final:
        checks = plan["stages"]["check_steps"]
        training["max_steps"] = checks.get(devices, checks.get(str(devices), plan["stages"]["default_check_steps"]))
    spec = {
        "stage": name,
        "data_path": training_data,
        "output_dir": str(stage_dir),
        "model": {k: v for k, v in plan["model"].items() if k != "lora"}
        | {f"lora_{k}": v for k, v in plan["model"]["lora"].items() if v is not None},
        "training": training,
    }
    spec["spec_hash"] = spec_hash(spec)
    check_stage_lock(stage_dir)  # a folder a live process still writes is neither reused nor deleted
    if training.get("reuse_finished", True):
        started = time.perf_counter()
        result, why = reusable_result(stage_dir, spec["spec_hash"])
        if result is not None:
            log.info("stage %s: reusing the finished result in %s (%s; checked in %.2f s)", name, stage_dir, why,
                     time.perf_counter() - started)
            result["final"], result["reused"] = final, True
            return result
        if stage_dir.exists():
            log.info("stage %s: not reusing %s: %s", name, stage_dir, why)
    if not training["resume"] and stage_dir.exists():
        shutil.rmtree(stage_dir)
    result = run_stage(stage_dir, spec, devices, plan["device_type"], _strategy_template(plan), _tracking_env())
    if result.get("tracking_failures"):
        log.warning("stage %s finished, but MLflow tracking failed %d time(s) (figures are in result.json): %s",
                    name, len(result["tracking_failures"]), result["tracking_failures"][0])
    result["final"], result["reused"] = final, False
    return result


def schedule_problem(result: dict) -> str | None:
    """Why the stage's logged learning rates do not follow its schedule to the end, or None."""
    if "schedule" not in result or result["steps"] != result["schedule"]["total_steps"]:
        return None  # a stage stopped early, or a result from before schedules were recorded
    schedule = Schedule(**result["schedule"])
    if len(result["learning_rates"]) != result["steps"]:
        return f"{len(result['learning_rates'])} learning rates logged for {result['steps']} steps"
    last_step, last_lr = result["learning_rates"][-1]
    expected = schedule.lr_at(last_step)
    if abs(last_lr - expected) > 1e-9 * schedule.base_lr + 1e-15:
        return f"final learning rate {last_lr:.3e} at step {last_step}, the schedule ends at {expected:.3e}"
    return None


def check_stage(result: dict, plan: dict) -> dict:
    """The gate between stages: finite loss, a falling loss from 2 devices on, replicas in sync."""
    if result.get("result_on_machine_rank_0"):  # multi-node: machine rank 0 holds the result and gates it
        log.info("stage %s: machine rank %d trained its part; the gate runs on machine rank 0", result["stage"],
                 result["machine_rank"])
        return result
    gate, where = plan["stages"]["gate"], f"(logs: {Path(result['adapter_dir']).parent / 'launch.log'})"
    losses = [loss for _, loss in result["losses"]]
    if gate["require_finite"] and (not losses or not all(math.isfinite(x) for x in losses)):
        bad = next((step for step, loss in result["losses"] if not math.isfinite(loss)), None)
        if bad is None and result.get("skipped_steps"):  # every step was skipped as non-finite
            bad = result["skipped_steps"][0][0]
        raise StageGateError(f"gate 'finite loss' failed for {result['stage']}: non-finite loss at step {bad} {where}")
    if result["devices"] >= gate["check_loss_fall_from_devices"] and len(losses) >= 3:
        third = max(1, len(losses) // 3)
        first, last = sum(losses[:third]) / third, sum(losses[-third:]) / third
        if last > first * (1 + gate["loss_fall_tolerance"]):
            raise StageGateError(
                f"gate 'loss falls' failed for {result['stage']}: mean loss {first:.4f} over the first third "
                f"vs {last:.4f} over the last (tolerance {gate['loss_fall_tolerance']}) {where}"
            )
    lr_problem = schedule_problem(result)
    if lr_problem:
        raise StageGateError(f"gate 'learning-rate schedule' failed for {result['stage']}: {lr_problem} {where}")
    if result["replica_max_diff"] > gate["replica_tolerance"]:
        raise StageGateError(
            f"gate 'replicas in sync' failed for {result['stage']}: parameters differ across ranks by "
            f"{result['replica_max_diff']:.3g} > {gate['replica_tolerance']} {where}"
        )
    log.info("gate passed for %s: final loss %.4f, %.1f pairs/s", result["stage"], losses[-1], result["pairs_per_s"])
    return result


def collect_stage_results(*results: dict) -> list[dict]:
    """The stages that ran, in order (check stages not below `gpus` are marked skipped)."""
    return [r for r in results if not r.get("skipped")]
