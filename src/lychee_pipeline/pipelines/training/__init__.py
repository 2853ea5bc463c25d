"""Staged Accelerate training pipeline."""

from .pipeline import create_pipeline, create_smoke_pipeline

__all__ = ["create_pipeline", "create_smoke_pipeline"]
