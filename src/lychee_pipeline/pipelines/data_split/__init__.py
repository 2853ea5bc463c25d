"""Query-grouped split and the smoke subset (05_model_input)."""

from lychee_pipeline.pipelines.data_split.pipeline import create_pipeline

__all__ = ["create_pipeline"]
