"""Planning a staged training run, Kedro-free: validate the parameters, lay out the device ladder, export the
training table, describe each stage as a `StageSpec`, reuse a finished stage or launch it, and return its
`StageResult`.

The pipeline nodes (`pipelines/training/nodes.py`) are thin wrappers over these functions.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from pydantic import BaseModel, ConfigDict

from lychee_pipeline.reranker.model import ModelConfig
from lychee_pipeline.tracking import check_stage_tracking
from lychee_pipeline.training import checkpoints
from lychee_pipeline.training.config import StageParams, TrainingParams
from lychee_pipeline.training.stage_launch import run_stage
from lychee_pipeline.runtime.errors import InvalidParameter, UnreadableData, validated
from lychee_pipeline.runtime.launcher import check_device_count, resolve_device
from lychee_pipeline.runtime.processes import check_stage_lock
from lychee_pipeline.training.stage import (
    RESULT_FILE,
    StageOutcome,
    StageResult,
    StageSpec,
    stage_outcome,
)

log = logging.getLogger(__name__)

# Check-stage slots of the staged pipeline (Kedro needs a fixed DAG): rung k runs on 2**(k-1) devices.
# 8 rungs cover check stages on 1 ... 128 devices, so gpus up to 256; a larger gpus is refused by the plan.
CHECK_RUNGS = 8
MAX_GPUS = 2 ** CHECK_RUNGS


def stage_devices(gpus: int) -> list[int]:
    """The staging ladder: powers of two below `gpus`, then `gpus` (4 -> [1, 2, 4], 3 -> [1, 2, 3]).

    The one definition of the ladder: the plan lays it out and the staged pipeline's rungs follow it.
    """
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    ladder, n = [], 1
    while n < gpus:
        ladder.append(n)
        n *= 2
    return ladder + [gpus]


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def check_model_source(name_or_path: str) -> None:
    """`model.name_or_path` must be builtin:tiny, an existing folder, or a hub id (org/name)."""
    if name_or_path.startswith("builtin:"):
        from lychee_pipeline.reranker.tiny import TINY_MODELS

        if name_or_path not in TINY_MODELS:
            raise InvalidParameter(f"invalid parameter model.name_or_path: unknown built-in model {name_or_path!r} "
                                   f"(known: {', '.join(TINY_MODELS)})")
        return
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return
    if path.exists():
        raise InvalidParameter(f"invalid parameter model.name_or_path: {name_or_path!r} is a file, not a model folder")
    if not _HUB_ID.match(name_or_path) or name_or_path.startswith((".", "/", "~")):
        raise InvalidParameter(f"invalid parameter model.name_or_path: no such folder {name_or_path!r} "
                               "(and not a hub id of the form org/name)")


def check_strategy(strategy: str, device_type: str) -> None:
    """Refuse, in one line before anything launches, a sharded strategy that cannot run here.

    fsdp2 on CPU: Accelerate (1.16) sets up FSDP only for GPU-type devices; with the CPU it quietly makes the
    processes plain gloo DDP (`DistributedType.MULTI_CPU`, full unsharded checkpoints), so the template would
    be ignored without a word. DeepSpeed is not installed here and its ZeRO needs CUDA GPUs.
    """
    if strategy == "fsdp2" and device_type != "cuda":
        raise InvalidParameter("invalid parameter training.launch.strategy: fsdp2 runs on CUDA GPUs only (Accelerate "
                               "sets up FSDP for GPUs; on CPU it would silently train plain DDP); on CPU use ddp")
    if strategy in ("zero2", "zero3"):
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            raise InvalidParameter(f"invalid parameter training.launch.strategy: {strategy} needs DeepSpeed, which is "
                                   "not installed (pip install deepspeed, on a machine with CUDA GPUs); use ddp or "
                                   "fsdp2")
        if device_type != "cuda":
            raise InvalidParameter(f"invalid parameter training.launch.strategy: {strategy} (DeepSpeed ZeRO) runs on "
                                   "CUDA GPUs only here; on CPU use ddp or fsdp2")


def rung_devices() -> list[int]:
    """Devices of each check-stage slot of the staged pipeline: 1, 2, 4, ... 2**(CHECK_RUNGS-1)."""
    return [2 ** k for k in range(CHECK_RUNGS)]


class StageSlot(BaseModel):
    """One stage slot of the staged pipeline: which stage it runs, if any."""

    model_config = ConfigDict(extra="forbid")

    devices: int | None  # None: this run's ladder has no stage here
    final: bool


class UnusedSlot(BaseModel):
    """What a slot reports when this run's ladder has no stage there (Kedro saves no None)."""

    model_config = ConfigDict(extra="forbid")

    unused_slot: Literal[True] = True
    reason: str


def slot_outcome(values: dict[str, Any]) -> StageOutcome | UnusedSlot:
    """What a stage slot's dataset holds, typed: an unused slot, else the stage's outcome."""
    return UnusedSlot.model_validate(values) if values.get("unused_slot") else stage_outcome(values)


class TrainingPlan(BaseModel):
    """The validated parameters and the ladder, written once per run (the `training_plan` dataset)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    device_type: Literal["cuda", "cpu"]
    gpus: int
    ladder: list[int]  # devices of each stage: the check stages, then the final stage on `gpus`
    run_dir: str
    model: ModelConfig
    training: TrainingParams
    stages: StageParams
    strategy_templates: str  # the folder of the Accelerate templates (ddp needs none)

    def stage_slots(self) -> list[StageSlot]:
        """The staged pipeline's slots, in order: one per check rung (rung k on 2**(k-1) devices), then the final
        stage. A rung `gpus` does not need (its devices not below `gpus`) has `devices` None and launches nothing."""
        checks = set(self.ladder[:-1])
        return [StageSlot(devices=d if d in checks else None, final=False) for d in rung_devices()] + \
            [StageSlot(devices=self.gpus, final=True)]


def plan_training(
    model: dict, training: dict, stages: dict, gpus: int, device: str, run: dict, overrides: dict | None = None
) -> TrainingPlan:
    """Validate the parameters and lay out the stages (1, 2, 4, ... up to `gpus`) before anything launches.

    A bad parameter raises ParameterError (a ValueError) in one line naming it, e.g.
    `invalid parameter training.learning_rate: Input should be greater than 0 (got -0.0001)`; an unknown key
    is one too (`invalid parameter model.lora_rank: Unexpected keyword argument (got 8)`).
    """
    if model.get("trust_remote_code"):
        raise InvalidParameter("invalid parameter model.trust_remote_code: remote code is never run "
                               "(Qwen2.5-VL is a native transformers model); set it to false")
    model_config = validated(ModelConfig, "model", model)
    training_params = validated(TrainingParams, "training", {**training, **(overrides or {})})
    stage_params = validated(StageParams, "stages", stages)
    check_model_source(model_config.name_or_path)
    launch = training_params.launch
    if launch.machine_rank >= launch.num_machines:
        raise InvalidParameter(f"invalid parameter training.launch.machine_rank: {launch.machine_rank} must be below "
                               f"training.launch.num_machines {launch.num_machines}")
    if launch.num_machines > 1 and not launch.main_process_port:
        raise InvalidParameter("invalid parameter training.launch.main_process_port: a multi-node run needs the same "
                               "fixed port on every machine (null picks a free one on each)")
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise InvalidParameter(f"parameter gpus must be a positive integer, got {gpus!r}")
    if gpus > MAX_GPUS:
        raise InvalidParameter(f"parameter gpus={gpus} needs more check stages than the staged pipeline has rungs "
                               f"({CHECK_RUNGS}, so gpus <= {MAX_GPUS}); raise training.planning.CHECK_RUNGS")
    device_type = resolve_device(device)
    check_device_count(gpus, device_type)
    if device_type == "cpu":
        log.info("no CUDA device in use: gpus=%d runs as %s (gloo)", gpus,
                 "1 CPU process" if gpus == 1 else f"{gpus} CPU processes")
    if model_config.finetune == "qlora" and device_type != "cuda":
        raise InvalidParameter("model.finetune=qlora needs a CUDA GPU (bitsandbytes 4-bit); use lora or full on CPU")
    check_strategy(launch.strategy, device_type)
    ladder = stage_devices(gpus)
    run_dir = Path(run["output_root"]) / run["name"]
    log.info("training plan: stages on %s device(s), outputs in %s", " -> ".join(map(str, ladder)), run_dir)
    return TrainingPlan(device_type=device_type, gpus=gpus, ladder=ladder, run_dir=str(run_dir), model=model_config,
                        training=training_params, stages=stage_params,
                        strategy_templates=run.get("accelerate_templates", "conf/base/accelerate"))


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


def unfillable_groups(records: pa.Table, group_size: int) -> dict[str, Any]:
    """The records whose group of ``group_size`` the negative draw (``training.negative_fill: fill_random``)
    cannot fill: their own negatives plus what the draw can use (`collate.drawable_negative_counts`: the
    distinct documents of the other records, leaving out any equal to one of their own positives or negatives)
    fall short of ``group_size - 1``. Also the largest group_size every record can fill (0 when none)."""
    from lychee_pipeline.reranker.collate import drawable_negative_counts

    rows = records.select(["record_id", "positives", "negatives"]).to_pylist()
    counts = [(str(row["record_id"]), len(row["negatives"] or []), drawable)
              for row, drawable in zip(rows, drawable_negative_counts(rows))]
    short = [(record, own, drawable) for record, own, drawable in counts if own + drawable < group_size - 1]
    largest = min((own + drawable + 1 for _, own, drawable in counts), default=0)  # 1 positive + the negatives
    return {"records": len(rows), "short": short, "largest_group_size": largest if largest >= 2 else 0}


def export_training_table(train_records: pa.Table, plan: TrainingPlan) -> str:
    """Write the training split once per run as Parquet, for the stage processes to memory-map.

    Records with fewer than ``training.group_size - 1`` negatives: under ``training.negative_fill: refuse``
    the run stops here with a one-line error naming both keys; under ``fill_random`` their groups are filled
    from other records' documents at batch time, and the number of filled slots per epoch is logged.
    """
    if train_records.num_rows == 0:  # before a launch, whose ranks would fail on an empty table far from the cause
        raise UnreadableData(
            "the training split has no records: the data layer refused, quarantined or split away every record; the "
            "reasons are in data/03_primary/quarantined_records.parquet and data/02_intermediate/rejected_lines.jsonl"
            " (a wrong data.image_roots quarantines every record with an image as 'image not found')")
    group_size = plan.training.group_size
    policy = plan.training.negative_fill
    short = short_group_counts(train_records, group_size)
    if short["short_records"]:
        where = (f"{short['short_records']} of {short['records']} training records have fewer than "
                 f"{group_size - 1} negatives (fewest: {short['fewest_negatives']})")
        if policy == "refuse":
            raise InvalidParameter(
                f"invalid parameters training.group_size={group_size} with training.negative_fill=refuse: {where}; "
                f"set data_processing.normalization.min_negatives to at least {group_size - 1} (short records are "
                "quarantined), lower training.group_size, or use training.negative_fill=fill_random"
            )
        unfillable = unfillable_groups(train_records, group_size)
        if unfillable["short"]:
            record, own, drawable = unfillable["short"][0]
            largest = unfillable["largest_group_size"]
            fits = (f"training.group_size is at most {largest} for this data" if largest
                    else "no training.group_size fits this data")
            raise InvalidParameter(
                f"invalid parameter training.group_size={group_size}: {len(unfillable['short'])} of "
                f"{unfillable['records']} training records cannot fill a group with {group_size - 1} negatives "
                f"(group_size - 1) from their own negatives and the documents of the other training records that "
                f"are not one of their own positives or negatives (same doc_id, or same text and image), e.g. "
                f"record {record}: {own} own + {drawable} to draw; {fits}: use a smaller training.group_size or "
                "more data (records, or negatives per record)"
            )
        log.info("negative_fill=fill_random: %s; %d group slot(s) per epoch are filled with random negatives "
                 "from other records' documents (hard=false)", where, short["filled_slots_per_epoch"])
    path = Path(plan.run_dir) / "train.parquet"
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


def tracking_env() -> dict[str, str]:
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


def strategy_template(plan: TrainingPlan) -> dict | None:
    """The Accelerate template of `training.launch.strategy` (None for plain DDP)."""
    strategy = plan.training.launch.strategy
    if strategy == "ddp":
        return None
    path = Path(plan.strategy_templates) / f"{strategy}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"training.launch.strategy={strategy}: no Accelerate template at {path}")
    return yaml.safe_load(path.read_text())


def stage_name(devices: int, device_type: str, final: bool) -> str:
    return f"stage_{devices}{'gpu' if device_type == 'cuda' else 'cpu'}" + ("_final" if final else "")


def stage_spec(plan: TrainingPlan, training_data: str, devices: int, final: bool) -> StageSpec:
    """The spec of one stage (hashed): a check stage runs `stages.check_steps` steps, the final one the epochs."""
    name = stage_name(devices, plan.device_type, final)
    training = plan.training
    if not final:
        steps = plan.stages.check_steps.get(devices, plan.stages.default_check_steps)
        training = training.model_copy(update={"max_steps": steps})
    return StageSpec(stage=name, data_path=training_data, output_dir=str(Path(plan.run_dir) / name),
                     model=plan.model, training=training).with_hash()


def reusable_result(stage_dir: Path, wanted_hash: str) -> tuple[StageResult | None, str]:
    """A finished stage's result if its spec hash matches and its adapter verifies, else (None, why not)."""
    result_path = stage_dir / RESULT_FILE
    if not result_path.is_file():
        return None, "not finished (no result.json)"
    try:
        result = StageResult.read(result_path)
    except ValueError as exc:
        return None, f"unreadable result.json: {str(exc).splitlines()[0]}"
    if result.spec_hash != wanted_hash:
        return None, "parameters or training data changed (spec hash differs)"
    # Read where the stage folder is now (a copied or moved project), not where it was written.
    adapter_dir, manifest = stage_dir / Path(result.adapter_dir).name, stage_dir / Path(result.adapter_manifest).name
    problem = checkpoints.verify_folder(adapter_dir, manifest)
    if problem:
        return None, f"adapter does not verify: {problem}"
    return result.model_copy(update={"adapter_dir": str(adapter_dir), "adapter_manifest": str(manifest)}), \
        "finished, spec and adapter unchanged"


def run_training_stage(training_data: str, plan: TrainingPlan, devices: int, final: bool) -> StageOutcome:
    """Launch one stage (a short check, or the final run for the configured epochs) and return its result.

    With `training.reuse_finished` a stage whose result.json records the same spec hash and whose adapter
    matches its sha256 manifest is not launched again: its stored result is returned.
    """
    spec = stage_spec(plan, training_data, devices, final)
    stage_dir = Path(spec.output_dir)
    check_stage_lock(stage_dir)  # a folder a live process still writes is neither reused nor deleted
    if spec.training.reuse_finished:
        started = time.perf_counter()
        result, why = reusable_result(stage_dir, spec.spec_hash)
        if result is not None:
            log.info("stage %s: reusing the finished result in %s (%s; checked in %.2f s)", spec.stage, stage_dir,
                     why, time.perf_counter() - started)
            return result.model_copy(update={"final": final, "reused": True})
        if stage_dir.exists():
            log.info("stage %s: not reusing %s: %s", spec.stage, stage_dir, why)
    if not spec.training.resume and stage_dir.exists():
        shutil.rmtree(stage_dir)
    if spec.training.resume:
        log.info("stage %s: %s", spec.stage, checkpoints.resume_note(stage_dir / "checkpoints"))
    outcome = stage_outcome(run_stage(stage_dir, spec, devices, plan.device_type, strategy_template(plan),
                                      tracking_env()))
    if isinstance(outcome, StageResult) and outcome.tracking_failures:
        check_stage_tracking(outcome.tracking_failures, spec.stage, str(stage_dir))  # a server gone: stop here
        log.warning("stage %s finished, but MLflow tracking failed %d time(s) (figures are in result.json): %s",
                    spec.stage, len(outcome.tracking_failures), outcome.tracking_failures[0])
    return outcome.model_copy(update={"final": final, "reused": False})
