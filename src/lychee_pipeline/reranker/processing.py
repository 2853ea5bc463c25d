"""How pairs are turned into model inputs: the settings that must be the same when a model is trained and scored.

A stage saves its `ProcessingConfig` into the saved folder's metadata (`lychee_reranker.json`, key
`processing`); `Reranker.from_pretrained` reads it back, so the evaluation nodes, the MLflow model and a user's
own scoring use the pixel budget and length the model was trained with unless the caller overrides them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .collate import DEFAULT_MAX_LENGTH, DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS


@dataclass(frozen=True)
class ProcessingConfig:
    """Pixel budget per image, token budget per pair and instruction overrides ({task_type: text})."""

    max_length: int = DEFAULT_MAX_LENGTH
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    instructions: Mapping[str, str] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "instructions": dict(self.instructions) if self.instructions else None}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ProcessingConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown processing settings {unknown}; known: {sorted(known)}")
        return cls(**values)

    def overridden(self, **overrides: Any) -> ProcessingConfig:
        """These settings with the caller's explicit values (those not None) put in."""
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})
