"""Export pipeline: `kedro run --pipelines export --params export.model=models:/lychee-reranker/3` (or a folder).

Inputs: ``params:export`` only. Output: ``export_summary`` (what was exported, where, with which figures); the
model folder itself is written by the node at ``export.output_dir`` (default data/06_models/exports/<name>).
"""

from __future__ import annotations

from kedro.pipeline import Node, Pipeline

from .nodes import export_merged_model


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline([
        Node(export_merged_model, "params:export", "export_summary", name="export_merged_model", tags=["export"]),
    ])
