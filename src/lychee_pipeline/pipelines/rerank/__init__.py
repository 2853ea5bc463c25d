"""Batch rerank: score a candidates file with a registered (or local) model, ranks per query, a summary."""

from .pipeline import create_pipeline

__all__ = ["create_pipeline"]
