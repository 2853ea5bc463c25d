"""Rerank pipeline: `kedro run --pipelines rerank --params "rerank.input=<jsonl>,rerank.model=<uri>"`.

Inputs: ``params:rerank`` only (the candidates file and the model are parameters).
Outputs: ``rerank_results`` (one JSON line per input line: ranked documents or the refusal reason),
``rerank_scores`` (Parquet, one row per document) and ``rerank_summary``. The model loads first: its image
roots (the served model's) decide which image paths the candidates may use.
"""

from __future__ import annotations

from kedro.pipeline import Node, Pipeline

from .nodes import load_rerank_model, read_candidates, score_and_rank


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            Node(load_rerank_model, "params:rerank", "rerank_model", name="load_rerank_model", tags=["rerank"]),
            Node(read_candidates, ["rerank_model", "params:rerank"], "rerank_candidates",
                 name="read_rerank_candidates", tags=["rerank"]),
            Node(score_and_rank, ["rerank_candidates", "rerank_model", "params:rerank"],
                 ["rerank_results", "rerank_scores", "rerank_summary"], name="score_and_rank_candidates",
                 tags=["rerank"]),
        ]
    )
