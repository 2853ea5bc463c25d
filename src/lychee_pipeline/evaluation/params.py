"""The ``evaluation:`` parameters as one typed object, validated where an evaluation node takes them.

Each field is what ``conf/base/parameters_evaluation.yml`` documents; a missing key takes the default here,
an unknown or ill-typed one is a one-line error naming it (``invalid parameter evaluation.seed: ...``).
Kedro-free; needs pydantic only.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from lychee_pipeline.evaluation.business import DEFAULT_KS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ScoringParams(_Strict):
    processes: PositiveInt | None = None  # None: `gpus` (GPUs, or CPU processes without CUDA)
    work_dir: str = "data/07_model_output/scoring"


class ScoreCacheParams(_Strict):
    enabled: bool = True
    dir: str = "data/07_model_output/score_cache"


class SignificanceParams(_Strict):
    n_resamples: PositiveInt = 10_000
    confidence_level: float = Field(0.95, gt=0.0, lt=1.0)


class BusinessParams(_Strict):
    ks: list[PositiveInt] = list(DEFAULT_KS)
    examination: Literal["log2", "reciprocal"] | list[float] = "log2"
    tail_fraction: float = Field(0.8, gt=0.0, le=1.0)


class ScalingParams(_Strict):
    full_train_pairs: PositiveInt | None = None  # None: from the stage results


class EvaluationParams(_Strict):
    max_queries: PositiveInt | None = None  # score only the first N test queries
    check_stage_queries: PositiveInt | None = 1000  # check stages on a seeded sample of this many (None: all)
    scoring: ScoringParams = ScoringParams()
    score_cache: ScoreCacheParams = ScoreCacheParams()
    seed: int = 0
    reranker: dict[str, Any] = {}  # keyword arguments of Reranker.from_pretrained (batch_size, device, ...)
    instructions: dict[str, str] | None = None  # {task_type: instruction} overrides
    significance: SignificanceParams = SignificanceParams()
    business: BusinessParams = BusinessParams()
    scaling: ScalingParams = ScalingParams()


def evaluation_params(values: EvaluationParams | dict[str, Any] | None) -> EvaluationParams:
    """The ``evaluation:`` parameters as `EvaluationParams` (as they are when already typed)."""
    if isinstance(values, EvaluationParams):
        return values
    from lychee_pipeline.runtime.errors import validated

    return validated(EvaluationParams, "evaluation", dict(values or {}))
