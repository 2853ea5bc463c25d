"""Run summary: metrics to the MLflow parent run, the trained reranker as an MLflow model, a closing summary."""

from .pipeline import create_pipeline

__all__ = ["create_pipeline"]
