"""The contract of one training stage: `StageSpec` (what to run) and `StageResult` (what it did).

Defined once, used everywhere a stage is described or reported: the planner writes a `StageSpec` as
`<stage>/spec.json`, every process of the stage reads it back (`training/train.py`), rank 0 writes a
`StageResult` as `<stage>/result.json`, and the gate, the scaling report, evaluation and reporting read
that result through this model. Both files stay plain, indented JSON.

Kedro-free, torch-free; needs pydantic only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lychee_pipeline.reranker.model import ModelConfig
from lychee_pipeline.reranker.processing import ProcessingConfig
from lychee_pipeline.training.config import TrainingParams

SPEC_FILE, RESULT_FILE = "spec.json", "result.json"


class _Contract(BaseModel):
    # an unknown field is an error, not a silently dropped key: every field is declared here
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class StageSpec(_Contract):
    """One stage, as its processes read it."""

    stage: str  # the stage folder's name, e.g. stage_2cpu or stage_4gpu_final
    data_path: str  # the training table (Parquet) every rank memory-maps
    output_dir: str  # the stage folder: checkpoints, adapter, result.json, logs
    model: ModelConfig  # how to load and fine-tune (the library's config)
    training: TrainingParams
    spec_hash: str | None = None  # see `spec_hash`; recorded in the result so a re-run can reuse the stage

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.model_dump(), indent=1, default=str))

    @classmethod
    def read(cls, path: Path) -> StageSpec:
        return cls.model_validate(json.loads(Path(path).read_text()))

    def with_hash(self) -> StageSpec:
        return self.model_copy(update={"spec_hash": spec_hash(self)})


# Keys that do not change what a stage computes: a finished stage is reused across them.
NOT_HASHED_TRAINING = {"resume", "reuse_finished"}
NOT_HASHED_LAUNCH = {"timeout_s", "process_group_timeout_s", "main_process_port", "watchdog_s",
                     "hang_after_exit_s", "rendezvous_timeout_s"}


def spec_hash(spec: StageSpec | dict[str, Any]) -> str:
    """sha256 of what determines a stage's outcome: its spec (less timeouts / resume flags) and its data bytes.

    Locations (the stage folder, the data file's path) are not hashed, so a copied or moved project reuses
    its finished stages; the data file's bytes are.
    """
    from lychee_pipeline.training import checkpoints

    values = spec.model_dump() if isinstance(spec, StageSpec) else StageSpec.model_validate(spec).model_dump()
    training = {k: v for k, v in values["training"].items() if k not in NOT_HASHED_TRAINING}
    training["launch"] = {k: v for k, v in training["launch"].items() if k not in NOT_HASHED_LAUNCH}
    outcome = {k: v for k, v in values.items() if k not in ("output_dir", "data_path", "spec_hash")}
    digest = hashlib.sha256(json.dumps({**outcome, "training": training}, sort_keys=True, default=str).encode())
    digest.update(checkpoints.sha256_file(Path(values["data_path"])).encode())
    return digest.hexdigest()


class StageResult(_Contract):
    """What a finished stage reports (written by rank 0 of `train.py`, then marked by the planner)."""

    stage: str
    devices: int = Field(ge=1)
    device_type: Literal["cuda", "cpu"]
    steps: int  # optimizer steps done
    train_pairs: int  # pairs trained on, all devices together
    full_train_pairs: int  # one epoch over the training split (for the scaling report's projections)
    wall_time_s: float
    pairs_per_s: float  # timed over the steps after the first
    peak_mem_gib: list[float]  # one per process
    # per-step figures as JSON rows (lists, so a reader may edit them like the JSON it came from)
    step_seconds: list[list[int | float]]  # [step, seconds] of every optimizer step
    losses: list[list[int | float]]  # [step, loss] of the finite steps
    learning_rates: list[list[int | float]]  # [step, learning rate]
    schedule: dict[str, Any] | None = None  # training.schedule.Schedule's fields
    skipped_steps: list[list[int | float]] = []  # [step, loss, gradient norm] of non-finite steps
    final_loss: float
    replica_max_diff: float
    truncation: dict[str, int] = {}
    processing: ProcessingConfig  # also saved in the adapter's metadata: what scoring uses
    negative_fill: dict[str, int] = {}
    dataloader: dict[str, Any] = {}
    timing: dict[str, Any] = {}  # training.step_timing: data wait, host issue, device span and gaps per step
    activation_checkpointing: dict[str, Any] | bool | str | None = None
    adapter_dir: str
    adapter_manifest: str
    spec_hash: str | None = None
    mlflow_run_id: str | None = None
    tracking_failures: list[str] = []
    records_seen: list[Any] | None = None  # tests only (LYCHEE_TRACE_RECORDS=1)
    # set by the planner, not by the processes:
    final: bool = False  # the final stage (on `gpus` devices, for the configured epochs), not a check stage
    reused: bool = False  # returned from an earlier run's folder without launching

    def write(self, path: Path) -> None:
        # plain json (not pydantic's JSON mode) so a non-finite loss stays NaN rather than null
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.model_dump(), indent=1))
        tmp.replace(path)

    @classmethod
    def read(cls, path: Path) -> StageResult:
        return cls.model_validate(json.loads(Path(path).read_text()))

    @property
    def launch_log(self) -> Path:
        return Path(self.adapter_dir).parent / "launch.log"


class MachineShare(_Contract):
    """A multi-node stage on machine rank > 0: it trained its part; machine rank 0 holds the StageResult."""

    stage: str
    machine_rank: int
    num_machines: int
    result_on_machine_rank_0: Literal[True] = True
    progress: str | None = None
    final: bool = False
    reused: bool = False


StageOutcome = StageResult | MachineShare


def stage_outcome(values: StageOutcome | dict[str, Any]) -> StageOutcome:
    """A stage's outcome from its JSON form (a catalog dataset, a result.json) or as it is."""
    if isinstance(values, (StageResult, MachineShare)):
        return values
    if values.get("result_on_machine_rank_0"):
        return MachineShare.model_validate(values)
    return StageResult.model_validate(values)


def as_stage_results(values: Iterable[StageResult | dict[str, Any]] | None) -> list[StageResult]:
    """The `stage_results` dataset (JSON rows, or results as they are) as `StageResult`s, in order.

    The boundary where evaluation and reporting take a run's stages: a row that is not a complete result (an
    undeclared or missing field, a machine rank > 0 share) is a one-line error naming the stage and the fields.
    """
    results = []
    for index, value in enumerate(values or []):
        name = value.stage if isinstance(value, (StageResult, MachineShare)) else value.get("stage", f"#{index}")
        try:
            outcome = stage_outcome(value)
        except ValidationError as error:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors(include_url=False))
            raise ValueError(f"stage result {name!r} is not a valid StageResult: {problems}") from None
        if isinstance(outcome, MachineShare):
            raise ValueError(f"stage result {name!r} is machine rank {outcome.machine_rank}'s share; "
                             "machine rank 0 holds the StageResult")
        results.append(outcome)
    return results
