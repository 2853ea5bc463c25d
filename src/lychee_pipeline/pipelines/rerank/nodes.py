"""Batch rerank nodes over `lychee_pipeline.rerank` (the model, its image roots, the refusal limit, scoring
and ranks) and `lychee_pipeline.data.candidates` (the file format and what is refused)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from lychee_pipeline import rerank as batch
from lychee_pipeline.data.params import RerankParams
from lychee_pipeline.runtime.errors import typed


def load_rerank_model(rerank: dict[str, Any]) -> batch.RerankModel:
    """The scorer of ``rerank.model`` (an MLflow model as the server loads it) and the roots it serves with."""
    return batch.load_model(typed(RerankParams, "rerank", rerank))


def read_candidates(rerank_model: batch.RerankModel, rerank: dict[str, Any]) -> dict[str, Any]:
    """Parse and check every line of ``rerank.input`` under the model's image roots; more refused documents
    than ``rerank.max_refused_share`` stop the run here, before scoring."""
    return batch.read_candidates(typed(RerankParams, "rerank", rerank), rerank_model)


def score_and_rank(candidates: dict[str, Any], rerank_model: batch.RerankModel,
                   rerank: dict[str, Any]) -> tuple[list[dict], pd.DataFrame, dict]:
    """Scores and ranks per scored line, refusals with their reasons, and the summary."""
    return batch.score_and_rank(candidates, rerank_model, typed(RerankParams, "rerank", rerank))
