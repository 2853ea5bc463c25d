"""The ``data:``, ``data_processing:`` and ``rerank:`` parameters as typed objects (Kedro-free).

Each field is what ``conf/base/parameters_data.yml`` / ``parameters_rerank.yml`` document, with the same
default (tests/data/test_params.py checks that they agree); an unknown or ill-typed key is a one-line error
naming it, with the closest known key (``invalid parameter data_processing.split.sed: ...; did you mean
data_processing.split.seed?``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator

from lychee_pipeline.data.images import MAX_ASPECT_RATIO, parse_image_roots
from lychee_pipeline.data.records import MAX_TEXT_CHARS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _WithImageRoots(_Strict):
    @field_validator("image_roots", mode="before", check_fields=False)
    @classmethod
    def _roots(cls, value: Any) -> list[str]:  # a YAML list, or one ':'-separated string from --params
        return parse_image_roots(value)


class DataParams(_WithImageRoots):
    """``data:``: where the raw JSONL and its images are (null: the generated demo catalogue)."""

    raw_path: str | None = None
    image_roots: list[str] = []  # []: the folder of the first JSONL file


class IngestionParams(_Strict):
    workers: int = 2  # processes parsing byte ranges (1: in this process)
    chunk_mb: float = 16
    batch_size: PositiveInt = 20000
    rejected_raw_chars: int = 10000
    max_text_chars: int = MAX_TEXT_CHARS  # checked where it is used, with the message the docs show


class ImageCheckParams(_Strict):
    workers: int = 2
    max_pixels: PositiveInt = 50_000_000
    max_aspect_ratio: float = MAX_ASPECT_RATIO


class NormalizationParams(_Strict):
    policy: str = "quarantine"  # quarantine | fail (checked where it is used)
    min_negatives: int = 1


class SplitRatios(_Strict):
    train: float = 0.8
    val: float = 0.1
    test: float = 0.1


class SplitParams(_Strict):
    method: str = "hash"  # hash | ordered (checked where it is used)
    seed: int = 42
    ratios: SplitRatios = SplitRatios()


class DataProcessingParams(_Strict):
    """``data_processing:``: the tuning of ingestion, the image check, normalization and the split."""

    ingestion: IngestionParams = IngestionParams()
    image_check: ImageCheckParams = ImageCheckParams()
    normalization: NormalizationParams = NormalizationParams()
    split: SplitParams = SplitParams()


class RerankParams(_WithImageRoots):
    """``rerank:``: the batch rerank's candidates file, model and limits (its input side is the data layer's)."""

    input: str | None = None
    model: str = "models:/lychee-reranker@champion"
    image_roots: list[str] = []  # []: the served model's roots, else the input's folder (lychee_pipeline/rerank.py)
    max_refused_share: float = Field(0.0, ge=0.0, le=1.0)  # more refused documents than this share stop the run
    max_image_pixels: PositiveInt = 50_000_000
    slice_pairs: PositiveInt = 1024
    reranker: dict[str, Any] = Field(default_factory=dict)  # Reranker.from_pretrained options
