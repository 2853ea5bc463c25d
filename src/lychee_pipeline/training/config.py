"""Training parameters as pydantic models, validated before any process is launched.

The ``model:`` parameters are the library's own :class:`~lychee_pipeline.reranker.model.ModelConfig` (validated
by pydantic where a plan or a stage spec embeds it); the processing defaults (``max_length``, ``min_pixels``,
``max_pixels``) are the library's, from ``reranker/collate.py``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator, model_validator
from pydantic_core import PydanticCustomError

from lychee_pipeline.reranker.collate import DEFAULT_MAX_LENGTH, DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS
from lychee_pipeline.runtime.settings import LaunchParams  # training.launch: how a stage is launched


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ResolutionStep(_Strict):
    start: float = Field(..., ge=0.0, lt=1.0)  # from this fraction of training progress on
    max_pixels: PositiveInt


class DataLoaderParams(_Strict):
    """Collation (image decode, resize, processor, negative sampling) in DataLoader worker processes.

    ``auto``: on CUDA min(4, CPUs per process - 1) workers, 2 batches prefetched per worker, persistent
    workers and pinned memory; on a CPU device collation stays in the training process (0 workers).
    """

    num_workers: int | Literal["auto"] = "auto"
    prefetch_factor: PositiveInt | Literal["auto"] = "auto"
    persistent_workers: bool | Literal["auto"] = "auto"
    pin_memory: bool | Literal["auto"] = "auto"

    @field_validator("num_workers")
    @classmethod
    def _non_negative(cls, value):
        if value != "auto" and value < 0:
            raise ValueError("must be >= 0 or auto")
        return value


class TrainingParams(_Strict):
    # Modules (import paths) whose import registers more losses: imported before `loss` is checked (fields
    # validate in order), in the planner and in every stage process reading its StageSpec.
    loss_modules: list[str] = []
    loss: str = "pointwise"  # a name registered in reranker/losses.py or by a loss module (pointwise, listwise, ...)
    temperature: float = Field(0.05, gt=0.0)
    group_size: int = Field(8, ge=2)
    # a record with fewer than group_size - 1 negatives: fill its group with other records' documents
    # (hard=false, seeded per epoch and record) or refuse the training table
    negative_fill: Literal["fill_random", "refuse"] = "fill_random"
    per_device_batch_size: PositiveInt = 1  # query groups per device per micro-step
    gradient_accumulation_steps: PositiveInt = 1
    learning_rate: float = Field(1e-4, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    warmup_ratio: float = Field(0.05, ge=0.0, lt=1.0)
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    max_grad_norm: float = Field(1.0, gt=0.0)
    max_nonfinite_steps: PositiveInt = 5  # skipped non-finite steps in a row before the stage stops
    epochs: float = Field(1.0, gt=0.0)
    max_steps: PositiveInt | None = None
    seed: int = 42
    max_length: PositiveInt = DEFAULT_MAX_LENGTH
    min_pixels: PositiveInt = DEFAULT_MIN_PIXELS
    max_pixels: PositiveInt = DEFAULT_MAX_PIXELS
    resolution_schedule: list[ResolutionStep] = []
    checkpoint_every: PositiveInt = 200
    keep_last: PositiveInt = 2
    resume: bool = False
    reuse_finished: bool = True  # a re-run returns a finished stage's result when its spec and adapter are unchanged
    log_every: PositiveInt = 1  # losses are read back from the device (one sync) only on logging steps
    memory_budget_gib: float = Field(40.0, gt=0.0)  # per device, for model.activation_checkpointing: auto
    dataloader: DataLoaderParams = DataLoaderParams()
    launch: LaunchParams = LaunchParams()

    @field_validator("loss_modules")
    @classmethod
    def _import_loss_modules(cls, value: list[str]) -> list[str]:
        from lychee_pipeline.reranker.losses import import_loss_modules

        import_loss_modules(value)
        return value

    @field_validator("loss")
    @classmethod
    def _registered_loss(cls, value: str) -> str:
        from lychee_pipeline.reranker.losses import LOSSES  # torch: imported only once a loss name is checked

        if value not in LOSSES:  # worded as pydantic words a Literal, naming every registered loss
            names = [repr(name) for name in LOSSES]
            expected = f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]
            raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})
        return value

    @model_validator(mode="after")
    def _pixels_ordered(self) -> "TrainingParams":
        if self.min_pixels > self.max_pixels:
            raise ValueError("min_pixels must not exceed max_pixels")
        return self

    def loss_options(self):
        """What the registered loss reads, by keyword from these parameters (so the loss sees this temperature,
        never `LossOptions`' own default)."""
        from lychee_pipeline.reranker.losses import LossOptions  # torch: only where a loss is computed

        return LossOptions(group_size=self.group_size, temperature=self.temperature)


class GateParams(_Strict):
    require_finite: bool = True
    # stage 2 must end with mean loss of its last third <= (1 + tolerance) x mean of its first third
    loss_fall_tolerance: float = Field(0.0, ge=0.0)
    check_loss_fall_from_devices: PositiveInt = 2
    replica_tolerance: float = Field(1e-5, ge=0.0)


class StageParams(_Strict):
    check_steps: dict[int, PositiveInt] = {1: 10, 2: 20}
    default_check_steps: PositiveInt = 10
    gate: GateParams = GateParams()

    @field_validator("check_steps", mode="before")
    @classmethod
    def _int_keys(cls, value):
        return {int(k): v for k, v in (value or {}).items()}
