"""Synthetic e-commerce catalogue: the embedded default data."""

from lychee_pipeline.pipelines.demo_data.pipeline import create_pipeline

__all__ = ["create_pipeline"]
